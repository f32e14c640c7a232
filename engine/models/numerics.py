"""The numerics a request's products and KV cache run in, `auto` resolved once at start.

For a GGUF kept quantized on the CPU (`--quantization gguf`, what auto picks there), the
default is llama.cpp's own numerics: int8 activations (`a8`) and a float16 KV cache. Its
divergence from the float32 dequantized model is no larger than llama.cpp's on the same file
(bench/RESULTS.md, `python -m bench.kld`: mean KLD 0.00311 against 0.00312). Every other model
keeps the exact products (`a32`) and a KV cache of the model's dtype, which equal HF
transformers token for token; `--quantization-numerics a32` restores them for a GGUF too.
"""

from __future__ import annotations

import torch

# auto: the model dtype, or float16 beside a8 (resolve_kv_dtype)
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16,
                   "fp8_e4m3": torch.float8_e4m3fn}


def resolve_numerics(numerics: str, quantization: str) -> str:
    """The concrete `--quantization-numerics` (a32 or a8) for a concrete quantization mode."""
    if numerics != "auto":
        return numerics
    return "a8" if quantization == "gguf" else "a32"


def resolve_kv_dtype(kv_cache_dtype: str, numerics: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: auto is float16 beside a8 (llama.cpp's), else `dtype`."""
    if kv_cache_dtype == "auto":
        return torch.float16 if numerics == "a8" else dtype
    if kv_cache_dtype == "float32" and dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype float32 needs a float32 model (dtype is "
                         f"{str(dtype).removeprefix('torch.')}): use auto or float16")
    return KV_CACHE_DTYPES[kv_cache_dtype]
