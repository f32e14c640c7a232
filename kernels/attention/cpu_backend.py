"""CPU backend: decodes in a C kernel that reads K/V (float32 or float16) through the block table.

The torch backend gathers each decode's blocks into a contiguous copy before its SDPA, which
reads and writes the whole cache once more than attention itself needs. `csrc/decode.c` walks
the blocks in place with an online softmax, one OpenMP task per sequence and split (16 tokens'
scores per vector for head dims of 64 and 128), each sequence's keys split every 16 blocks by
its own length (split-KV), never by its batch or the thread count. It is part of the one CPU
library (kernels/cpu/library.py), compiled on first use; it links the libgomp torch has
already loaded, so both share one thread pool. A float16 cache is widened in registers
(queries and outputs stay float32). KV writes of float32 rows into a float32 or float16 cache
are one C call too (both through kernels/cpu/decode.py). With `meta.invariant` (the engine's
--batch-invariant, its default) prefill chunks run through the same kernel, each query token
as the decode of its position (batch- and chunk-invariant, as decode is); without it they go
to SDPA. Soft-capped scores, other dtypes and the FP8 cache go to the torch backend.
Without a C compiler the backend is unavailable and `auto` stays on torch.
"""

from __future__ import annotations

import torch

from kernels.attention import torch_backend
from kernels.attention.metadata import AttentionMetadata
from kernels.cpu import decode as c_decode
from kernels.cpu import library
from kernels.cpu.decode import CACHE_DTYPES, MAX_BLOCK, MAX_GROUP, MAX_ROWS

__all__ = ["CACHE_DTYPES", "FUSED_CPU_OPS", "NAME", "decode", "fits", "paged_attention", "write_kv"]

NAME = "cpu"
# NOTE: at import: any failure is an ImportError, as for a missing triton
library.load()
# NOTE: with this backend the engine also runs RMSNorm and rope in C (kernels/cpu/ops.py);
# with the torch backend the whole model stays in torch: the reference.
FUSED_CPU_OPS = True


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as the torch backend's; float32 rows go into a float32 or float16 cache
    in one C call (float16 rounded to nearest even, as torch's cast rounds)."""
    if (k_scale is None and v_scale is None
            and key.dtype == value.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES
            and key.stride()[1:] == value.stride()[1:] == (key.shape[2], 1)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        bad = c_decode.write_kv(key, value, k_cache, v_cache, slot_mapping)
        if bad:
            raise IndexError(f"{bad} KV cache slots out of range")
        return
    torch_backend.write_kv(key, value, k_cache, v_cache, slot_mapping,
                           k_scale=k_scale, v_scale=v_scale)


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
) -> torch.Tensor:
    """Same contract as the torch backend's; decodes run in C where `fits` says they can
    (soft-capped scores go to the torch backend)."""
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decodes
    scales = (k_scale, v_scale)
    in_c = softcap is None and fits(q, k_cache, v_cache, out, k_scale, v_scale, meta)
    if nd and in_c:
        decode(q[:nd], k_cache, v_cache, meta, scale, out[:nd])
    elif nd:
        out[:nd] = torch_backend.decode(q[:nd], k_cache, v_cache, meta, scale, scales, softcap)
    if nd == meta.num_seqs:
        return out
    if in_c and meta.invariant:
        prefills(q, k_cache, v_cache, meta, scale, out)
    else:
        torch_backend.prefills(q, k_cache, v_cache, meta, scale, scales, out, softcap)
    return out


def prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, scale: float, out: torch.Tensor,
             num_threads: int | None = None) -> None:
    """The prefill chunks' query tokens (after the decodes), each attending as the decode
    kernel would at its position: its sequence's block table, its position + 1 keys.

    NOTE: so a token's attention is the same bits whether its position is computed in a
    prefill (in any chunking, beside any batch) or as a decode: the decode kernel's order
    depends on the sequence's length alone. SDPA's blocking follows the chunk's shape, and
    a8's int8 rounding turned its last-bit differences into logit differences of 0.4-0.6 on
    the bundled model between a prompt prefilled whole and in chunks of 100 tokens."""
    nd = meta.num_decodes
    tables, lens = meta.prefill_rows()
    c_decode.paged_decode(q[nd:], k_cache, v_cache, tables, lens, out[nd:], scale,
                          meta.window or 0, num_threads or torch.get_num_threads())


def fits(q, k_cache, v_cache, out, k_scale, v_scale, meta) -> bool:
    """float32 queries and outputs, a float32 or float16 cache, no FP8 scales, layouts the
    kernel indexes, sizes its arrays hold."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    return (q.device.type == "cpu" and k_scale is None and v_scale is None
            and q.dtype == out.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.stride()[1:] == (head_dim, 1) and out.stride()[1:] == (head_dim, 1)
            and meta.block_tables.dtype == torch.int64 and meta.block_tables.stride(1) == 1
            and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.is_contiguous()
            and group <= MAX_GROUP and block_size <= MAX_BLOCK and group * head_dim <= MAX_ROWS)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, out: torch.Tensor,
           num_threads: int | None = None) -> None:
    """Decodes (one query token per sequence, the first len(q) sequences) into `out`.

    Each sequence's keys are split every 16 blocks (by its own length alone) and the splits
    spread over the threads. `meta.window` bounds the keys read.
    """
    c_decode.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, scale,
                          meta.window or 0, num_threads or torch.get_num_threads())
