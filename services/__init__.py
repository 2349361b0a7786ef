"""The deepinfer processes: gateway, scheduler, worker, kvcache."""
