"""Engine process: scheduler, paged KV cache, model runner, sampler; `LLM` runs it in-process."""

from ipc.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # NOTE: lazy, so `python -m engine` and light imports (engine.sched) skip torch model code.
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
