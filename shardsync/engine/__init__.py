"""The reference rollout engine: TP worker processes with an HTTP server on the first."""
