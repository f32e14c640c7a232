"""Scheduling side of the engine: requests, KV blocks, the scheduler and one file per policy;
never imports torch, engine.run, engine.models or kernels (only ipc and engine.step_plan)."""
