"""The engine: the scheduler over one decode worker (continuous batching at iteration boundaries)."""
