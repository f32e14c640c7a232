"""Compute side of the engine: the runner, its rows, the sampler, draft verification and
pooling; reads the step plan (engine.step_plan), never engine.sched."""
