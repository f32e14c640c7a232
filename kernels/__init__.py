"""Paged attention and KV writes behind one small API, with lazily imported backends.

`get_backend("torch")` is the pure-torch reference every other backend is tested against;
`cpu` runs float32 decodes in a C kernel built on first use (needs a C compiler).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kernels.metadata import AttentionMetadata

# NOTE: optional backends import heavy packages (triton, flash-attn); import them on demand only.
BACKENDS = {
    "torch": "kernels.torch_backend",
    "cpu": "kernels.cpu_backend",
    "triton": "kernels.triton_backend",
    "flash_attn": "kernels.flash_attn_backend",
}


def get_backend(name: str = "torch", device_type: str = "cpu") -> ModuleType:
    """Return the backend module, which provides `write_kv` and `paged_attention`.

    `auto` picks flash_attn, then triton, on CUDA (where their packages import), cpu on the CPU
    (where its kernel builds), torch otherwise. A named backend that cannot load raises
    ValueError saying what is missing.
    """
    if name == "auto":
        name = auto_backend(device_type)
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; have {list(BACKENDS)}")
    if name == "cpu" and device_type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU only, not on {device_type}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} cannot be used here: {e}") from e


def auto_backend(device_type: str, cache_like_model: bool = True) -> str:
    """flash_attn, then triton, on CUDA; cpu on the CPU; the first that imports, else torch.
    cache_like_model False (an FP8 or float16 cache under another model dtype): not
    flash_attn, which reads a cache of the model's dtype only."""
    if device_type not in ("cuda", "cpu"):
        return "torch"
    cuda = ("flash_attn", "triton") if cache_like_model else ("triton",)
    for name in cuda if device_type == "cuda" else ("cpu",):
        try:
            importlib.import_module(BACKENDS[name])
        except ImportError:
            continue  # NOTE: optional package or compiler absent (or broken): try the next
        return name
    return "torch"


__all__ = ["AttentionMetadata", "BACKENDS", "auto_backend", "get_backend"]
