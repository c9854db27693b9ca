"""The cost of immediate updates, as ratios to plain JAX: ``python -m benchmarks``."""
