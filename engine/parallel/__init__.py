"""Tensor parallelism inside one engine: sharded layers, worker processes, the step ring."""
