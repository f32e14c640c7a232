"""Paged attention and KV writes behind the typed `Backend` protocol, one module per backend,
imported on demand through a registry. A new backend is one module and one `register` line.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from kernels.attention.metadata import AttentionMetadata


class Backend(Protocol):
    """What a backend module provides (`kernels/attention/torch_backend.py` is the reference
    every other backend is tested against)."""

    # its name in the registry: code that calls one backend's kernels itself (the CPU decode
    # stack, kernels/cpu/fused.py) recognises that backend by it
    NAME: str
    # NOTE: True where the engine should also run RMSNorm and rope in C (kernels/cpu/ops.py)
    FUSED_CPU_OPS: bool

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """New tokens' K/V rows [tokens, kv_heads, head_dim] into their cache slots
        (slot_mapping int64, -1 skipped); FP8 caches with their per-head scales."""
        ...

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, *,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
        """Attention of q [tokens, heads, head_dim] (decodes first, then prefill chunks)
        over the paged cache through meta's block tables; written into `out` when given."""
        ...


@dataclass(frozen=True)
class Registration:
    module: str  # the backend's module, imported on first use
    auto_on: tuple[str, ...] = ()  # device types `auto` may pick it on (registration order)
    runs_on: tuple[str, ...] | None = None  # device types it runs on; None: any
    # NOTE: False: reads a cache of the model's dtype only (not an FP8 or float16 cache
    # under another model dtype): `auto` passes it over for such caches
    any_cache_dtype: bool = True


BACKENDS: dict[str, Registration] = {}


def register(name: str, module: str, *, auto_on: tuple[str, ...] = (),
             runs_on: tuple[str, ...] | None = None, any_cache_dtype: bool = True) -> None:
    """Make backend `name` (its module path) available to get_backend and `auto`."""
    BACKENDS[name] = Registration(module, auto_on, runs_on, any_cache_dtype)


# NOTE: optional backends import heavy packages (triton, flash-attn); imported on demand only.
# `auto` tries them in this order on each device type.
register("flash_attn", "kernels.attention.flash_attn_backend", auto_on=("cuda",),
         any_cache_dtype=False)
register("triton", "kernels.attention.triton_backend", auto_on=("cuda",))
register("cpu", "kernels.attention.cpu_backend", auto_on=("cpu",), runs_on=("cpu",))
register("torch", "kernels.attention.torch_backend")


def get_backend(name: str = "torch", device_type: str = "cpu") -> Backend:
    """The backend module, which provides `write_kv` and `paged_attention`.

    `auto` picks flash_attn, then triton, on CUDA (where their packages import), cpu on the CPU
    (where its kernel builds), torch otherwise. A named backend that cannot load raises
    ValueError saying what is missing.
    """
    if name == "auto":
        name = auto_backend(device_type)
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; have {list(BACKENDS)}")
    runs_on = BACKENDS[name].runs_on
    if runs_on is not None and device_type not in runs_on:
        where = "the CPU" if runs_on == ("cpu",) else "/".join(runs_on)
        raise ValueError(f"attention backend {name!r} runs on {where} only, not on {device_type}")
    try:
        return cast(Backend, importlib.import_module(BACKENDS[name].module))
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} cannot be used here: {e}") from e


def auto_backend(device_type: str, cache_like_model: bool = True) -> str:
    """The first registered backend for `device_type` whose module imports, else torch.
    cache_like_model False (an FP8 or float16 cache under another model dtype): not a
    backend that reads the model's dtype only (flash_attn)."""
    for name, reg in BACKENDS.items():
        if device_type not in reg.auto_on or not (cache_like_model or reg.any_cache_dtype):
            continue
        try:
            importlib.import_module(reg.module)
        except ImportError:
            continue  # NOTE: optional package or compiler absent (or broken): try the next
        return name
    return "torch"


__all__ = ["AttentionMetadata", "BACKENDS", "Backend", "Registration", "auto_backend",
           "get_backend", "register"]
