"""Compute side of the engine: the runner, its rows, the sampler and draft verification;
reads the step plan (engine.step_plan), never engine.sched."""
