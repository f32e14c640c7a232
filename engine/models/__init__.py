"""Model definitions written here (the Llama layout, Gemma 2/3), their weight loaders, and what
the layers read: the forward context and its LoRA batch. Never imports engine.run or engine.sched.
"""
