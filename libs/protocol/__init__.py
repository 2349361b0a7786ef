"""Wire contract between deepinfer processes: message schemas, subject names, typed errors."""
