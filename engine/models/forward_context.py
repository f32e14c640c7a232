"""A scoped forward context: attention metadata and KV caches reach the layers through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import AttentionMetadata, Backend

if TYPE_CHECKING:
    from engine.models.lora_batch import LoraBatch


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    backend: Backend  # has write_kv() and paged_attention()
    lora: LoraBatch | None = None  # this step's rows with a LoRA adapter (engine/run/lora)


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "model forward called outside forward_context()"
    return _current


def step_lora() -> LoraBatch | None:
    """This step's rows with a LoRA adapter (None: none, or no step running): the fused paths
    that bypass the linears (the one-call decode stack and MLP) add their deltas themselves."""
    return None if _current is None else _current.lora
