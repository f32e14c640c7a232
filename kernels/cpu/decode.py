"""Paged decode attention and KV writes in C (csrc/decode.c) over float32 or float16 pools:
the calls and the sizes the kernel takes. kernels/attention/cpu_backend.py is the attention
backend over them; csrc/fused.c calls the same entry points.
"""

from __future__ import annotations

import torch

from kernels.cpu import library

MAX_GROUP, MAX_BLOCK, MAX_ROWS = 64, 64, 4096  # the C kernel's stack arrays
CACHE_DTYPES = (torch.float32, torch.float16)  # the pools' dtypes (queries, K/V rows: float32)
# pool dtype -> its (KV write, decode) entry points
_ENTRY = {torch.float32: ("write_kv_f32", "paged_decode_f32"),
          torch.float16: ("write_kv_f16", "paged_decode_f16")}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """float32 rows [tokens, kv_heads, head_dim] (contiguous heads) into their slots of a pool
    in CACHE_DTYPES (float16 saturated and rounded to nearest even); slot -1 is skipped.
    Returns the number of slots out of range (not written). Layouts not checked here."""
    width = key.shape[1] * key.shape[2]
    write = getattr(library.load(), _ENTRY[k_cache.dtype][0])
    return write(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                 k_cache.data_ptr(), v_cache.data_ptr(), k_cache.numel() // width,
                 slot_mapping.data_ptr(), key.shape[0], width)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scale: float,
                 window: int, num_threads: int) -> None:
    """One query token per sequence (q [seqs, heads, head_dim]) attends its keys through the
    int64 block tables; out [seqs, heads, head_dim]; window 0: every key. Not checked here."""
    nd, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    attend = getattr(library.load(), _ENTRY[k_cache.dtype][1])
    attend(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
           tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), out.stride(0), nd, heads,
           kv_heads, head_dim, block_size, scale, window, num_threads)
