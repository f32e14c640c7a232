"""Engine process: scheduler, paged KV cache, model runner, sampler; `LLM` runs it in-process."""
