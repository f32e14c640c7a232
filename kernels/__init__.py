"""Paged attention and KV writes behind one small API, with lazily imported backends.

`get_backend("torch")` is the pure-torch reference every other backend is tested against.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kernels.metadata import AttentionMetadata

# NOTE: optional backends import heavy packages (triton, flash-attn); import them on demand only.
BACKENDS = {
    "torch": "kernels.torch_backend",
}


def get_backend(name: str = "torch") -> ModuleType:
    """Return the backend module, which provides `write_kv` and `paged_attention`."""
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; have {list(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


__all__ = ["AttentionMetadata", "BACKENDS", "get_backend"]
