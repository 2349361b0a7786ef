"""What every service process shares: config from flags and env, the run loop and signals, /metrics."""
