"""Triton backend: fused paged attention that reads K/V through the block table (online softmax).

Decodes go to a split-KV decode kernel (splits when batch x KV heads cannot fill the GPU), the
rest to one varlen kernel with a bottom-right causal mask; both load each K/V tile once per
query group. Under TRITON_INTERPRET=1 (CPU tests) everything is upcast to fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch
import triton
from triton import knobs

from kernels.attention import torch_backend
from kernels.attention import triton_kernels as tk
from kernels.attention.metadata import AttentionMetadata

# NOTE: the interpreter gets bf16 arithmetic and tl.dot on 16-bit inputs wrong (it works on the
# raw bits), so kernels upcast right after loading when it is on.
INTERPRET: bool = bool(knobs.runtime.interpret)
NAME = "triton"
FUSED_CPU_OPS = False  # the model's norms and rope stay in torch (cpu_backend's says why)
FP8_DTYPES = (torch.float8_e4m3fn,)
MAX_SPLITS = 64  # the reduce kernel holds all splits of one head in registers
MIN_SPLIT_LEN = 256  # keys per split: below this the reduce costs more than it gains


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows of a program (query tokens x query group)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def varlen_config(head_dim: int) -> LaunchConfig:
    # NOTE: 8 warps: at 4 the 128-row tile spills registers (checked by the AOT test).
    if head_dim <= 64:
        return LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


def decode_config(head_dim: int) -> LaunchConfig:
    # 16 rows: the smallest tl.dot tile; one query group (<= 16 heads) per program
    return LaunchConfig(block_m=16, block_n=64 if head_dim > 64 else 128, num_warps=4,
                        num_stages=3)


WRITE_BLOCK_T = 16


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    *,
    k_scale: torch.Tensor | None = None,  # [] or [num_kv_heads] fp32: stored = x / scale
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    quant = k_cache.dtype in FP8_DTYPES
    kind, ks, vs = _scale_args(k_scale, v_scale, key.device)
    grid = (triton.cdiv(num_tokens, WRITE_BLOCK_T), kv_heads)
    tk.write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, ks, vs, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P2=_p2(head_dim),
        BLOCK_T=WRITE_BLOCK_T, QUANT=quant, PER_HEAD_SCALE=kind == 2, ROUND_IN_FP32=INTERPRET,
        num_warps=4,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_kv_splits: int | None = None,  # decode splits; None: chosen from the GPU's size
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attend every query token over its sequence's cached K/V (written before this call).
    Soft-capped scores (Gemma 2) go to the torch backend."""
    out = torch.empty_like(q) if out is None else out
    if softcap is not None:
        return torch_backend.paged_attention(q, k_cache, v_cache, meta, scale, k_scale=k_scale,
                                             v_scale=v_scale, out=out, softcap=softcap)
    nd = meta.num_decodes
    group = q.shape[1] // k_cache.shape[2]
    first = 0
    if nd and group <= decode_config(q.shape[2]).block_m:
        splits = num_kv_splits or num_splits_for(nd, k_cache.shape[2], meta.max_decode_seq_len,
                                                 _num_sms(q.device))
        decode_attention(q[:nd], k_cache, v_cache, meta, scale, out[:nd], splits,
                         k_scale=k_scale, v_scale=v_scale)
        first = nd
    if first < meta.num_seqs:
        varlen_attention(q, k_cache, v_cache, meta, scale, out, first,
                         k_scale=k_scale, v_scale=v_scale)
    return out


def varlen_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    first_seq: int = 0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The varlen kernel over sequences [first_seq, num_seqs): prefill, chunks and decodes."""
    _check(q, k_cache, out)
    cfg = varlen_config(q.shape[2])
    group = q.shape[1] // k_cache.shape[2]
    assert group <= cfg.block_m, f"query group {group} exceeds {cfg.block_m} rows"
    block_q = cfg.block_m // group
    starts = [0, *accumulate(meta.query_lens_cpu)]
    num_seqs = meta.num_seqs
    num_programs = (starts[num_seqs] // block_q + num_seqs) - (starts[first_seq] // block_q
                                                               + first_seq)
    kind, ks, vs = _scale_args(k_scale, v_scale, q.device)
    tables = meta.block_tables
    grid = (num_programs, k_cache.shape[2])
    tk.paged_attention_kernel[grid](
        out, q, k_cache, v_cache, tables, meta.seq_lens, meta.query_start_loc, ks, vs,
        scale, first_seq, num_seqs, group, block_q, _window(meta),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=q.shape[2], HEAD_DIM_P2=_p2(q.shape[2]), PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV_SCALE=kind, UPCAST=INTERPRET,
        DOT_PRECISION=_dot_precision(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]: the batch's first sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    num_splits: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The split-KV decode kernel, then (num_splits > 1) the reduce over splits."""
    _check(q, k_cache, out)
    nd, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    cfg = decode_config(head_dim)
    split_len, num_splits = split_plan(meta.max_decode_seq_len, num_splits, cfg.block_n)
    split = num_splits > 1
    part_out = part_lse = out  # unused unless split
    if split:
        part_out = torch.empty(nd, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(nd, num_heads, num_splits, dtype=torch.float32, device=q.device)
    kind, ks, vs = _scale_args(k_scale, v_scale, q.device)
    tables = meta.block_tables
    tk.decode_kernel[(nd, kv_heads, num_splits)](
        out, part_out, part_lse, q, k_cache, v_cache, tables, meta.seq_lens, ks, vs,
        scale, num_heads // kv_heads, split_len, num_splits, _window(meta),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_P2=_p2(head_dim), PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV_SCALE=kind, UPCAST=INTERPRET,
        DOT_PRECISION=_dot_precision(q), SPLIT=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        tk.decode_reduce_kernel[(nd, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P2=_p2(head_dim), SPLITS_P2=MAX_SPLITS, num_warps=4,
        )


def _window(meta: AttentionMetadata) -> int:
    return tk.NO_WINDOW.value if meta.window is None else meta.window


def split_plan(max_seq_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, a multiple of block_n; splits that the longest sequence reaches)."""
    max_seq_len = max(max_seq_len, 1)
    per_split = triton.cdiv(max_seq_len, min(num_splits, MAX_SPLITS))
    split_len = triton.cdiv(per_split, block_n) * block_n
    return split_len, triton.cdiv(max_seq_len, split_len)


def num_splits_for(num_decodes: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split the keys only while batch x KV heads leaves SMs idle (aim: two programs per SM)."""
    programs = num_decodes * kv_heads
    if programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, MIN_SPLIT_LEN), MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: small, so tests exercise the split path


def _check(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> None:
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def _scale_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    # (kind: 0 none, 1 per tensor, 2 per KV head, k_scale, v_scale)
    if k_scale is None and v_scale is None:
        one = _unit_scale(device)
        return 0, one, one
    assert k_scale is not None and v_scale is not None and k_scale.numel() == v_scale.numel()
    kind = 1 if k_scale.numel() == 1 else 2
    return kind, k_scale.float().contiguous(), v_scale.float().contiguous()


def _dot_precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))
