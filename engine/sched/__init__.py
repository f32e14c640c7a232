"""Scheduling side of the engine: requests, KV blocks, the scheduler and one file per policy.
Imports ipc, engine.step_plan and itself only (no torch, engine.run, engine.models, kernels)."""
