"""flash-attn backend: FlashAttention-3 (`flash_attn_interface`) or vLLM's `vllm_flash_attn` fork.

Both read K/V through a page table with 16-token pages; upstream flash-attn 2 needs pages
divisible by 256, so it is not accepted. Importing this module raises ImportError without them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from kernels.attention.metadata import AttentionMetadata

try:  # the KV write is ours: flash-attn's own writes assume a contiguous cache per sequence
    from kernels.attention.triton_backend import write_kv
except ImportError:
    from kernels.attention.torch_backend import write_kv

NAME = "flash_attn"
FUSED_CPU_OPS = False  # the model's norms and rope stay in torch (cpu_backend's says why)

# (module, kind) in order of preference; names are strings because they are probed at runtime
CANDIDATES = (("flash_attn_interface", "fa3"), ("vllm.vllm_flash_attn", "vllm"))


def _find() -> tuple[str, ModuleType]:
    tried = []
    for name, kind in CANDIDATES:
        try:
            return kind, importlib.import_module(name)
        except ImportError as e:
            tried.append(f"{name} ({e})")
    raise ImportError(
        "the flash_attn backend needs FlashAttention-3 (`flash_attn_interface`, built from "
        "flash-attention's hopper/) or vLLM's `vllm_flash_attn`: upstream flash-attn 2 accepts "
        "only pages divisible by 256 tokens. Use --attention-backend triton instead. Tried: "
        + "; ".join(tried)
    )


KIND, _FA = _find()


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One varlen call over the whole batch; causal=True is bottom-right aligned in flash-attn.
    A sliding window W is flash-attn's window_size (W - 1, 0): W keys, the query's included."""
    if k_cache.dtype != q.dtype or k_scale is not None or v_scale is not None:
        raise ValueError("the flash_attn backend reads a KV cache of the model's dtype only "
                         "(no FP8 or float16 cache here): use --attention-backend triton with "
                         "--kv-cache-dtype float16 or fp8_e4m3")
    # NOTE: flash-attn wants an int32 page table; the runner builds int64 for index_select.
    tables = meta.block_tables.to(torch.int32)
    max_q = max(meta.query_lens_cpu)
    extra = {"window_size": (-1, -1) if meta.window is None else (meta.window - 1, 0),
             "softcap": softcap or 0.0}  # NOTE: flash-attn's "none" for each
    if KIND == "fa3":
        res = _call(_FA.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=meta.seq_lens,
                    page_table=tables, cu_seqlens_q=meta.query_start_loc, max_seqlen_q=max_q,
                    softmax_scale=scale, causal=True, **extra)
    else:
        res = _call(_FA.flash_attn_varlen_func, q, k_cache, v_cache, max_seqlen_q=max_q,
                    cu_seqlens_q=meta.query_start_loc, max_seqlen_k=max(meta.seq_lens_cpu),
                    seqused_k=meta.seq_lens, block_table=tables, softmax_scale=scale,
                    causal=True, **extra)
    if out is None:
        return res
    out.copy_(res)
    return out


def _call(fn: Callable[..., torch.Tensor], *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
    res = fn(*args, **kwargs)
    return res[0] if isinstance(res, tuple) else res


__all__ = ["KIND", "paged_attention", "write_kv"]
