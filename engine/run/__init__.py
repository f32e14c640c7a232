"""Compute side of the engine: runner, rows, sampler, verification, pooling."""
