"""Compute kernels, two packages: `kernels.attention` (paged attention and KV writes behind
`get_backend`: torch reference, cpu, triton, flash_attn) and `kernels.cpu` (one C library of
CPU math: decode attention, norms and rope, quantized products, the fused decode stack).
"""

from __future__ import annotations

from kernels.attention import AttentionMetadata, Backend, auto_backend, get_backend

__all__ = ["AttentionMetadata", "Backend", "auto_backend", "get_backend"]
