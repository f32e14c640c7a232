"""Triton kernels over the paged KV cache: KV write, varlen paged attention, split-KV decode.

Launch logic and configurations live in triton_backend.py; this module is kernels only.
Cache layout: [num_blocks, page_size, num_kv_heads, head_dim], head_dim contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_E4M3_MAX = tl.constexpr(448.0)
LOG2E = tl.constexpr(1.4426950408889634)
NO_WINDOW = tl.constexpr(1 << 30)  # the window argument of a layer without one


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks * page_size, num_kv_heads, head_dim], contiguous
    slot_ptr,  # [num_tokens] int64, -1 = padding
    k_scale_ptr, v_scale_ptr,  # [] or [num_kv_heads] fp32 (read only when QUANT)
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, QUANT: tl.constexpr, PER_HEAD_SCALE: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    # one program: BLOCK_T tokens of one KV head
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + offs_t[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
                mask=mask, other=0.0)
    v = tl.load(value_ptr + offs_t[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
                mask=mask, other=0.0)
    if QUANT:
        scale_off = head if PER_HEAD_SCALE else 0
        # NOTE: clamp before the cast: out-of-range values must saturate, not become NaN.
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr + scale_off),
                     -FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr + scale_off),
                     -FP8_E4M3_MAX, FP8_E4M3_MAX)
        if ROUND_IN_FP32:
            k = _round_to_e4m3_grid(k)
            v = _round_to_e4m3_grid(v)
    dst = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3_grid(x):
    # x: fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), still in fp32.
    # NOTE: for the interpreter only, whose fp8 cast neither rounds to even nor carries a
    # rounded-up mantissa into the exponent; the GPU's cvt.rn.satfinite is exact already.
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2**-6: subnormal, same spacing
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2**23 ulps: x + magic has exactly `ulp` spacing
    r = ((x + magic) - magic).to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31  # keep the sign of values that round to zero
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _q_block_start(qsl_ptr, seq, block_q):
    # NOTE: sequence i owns program ids [qsl[i] // block_q + i, ...): an upper bound on the
    # cumulative number of query blocks that needs no prefix sum over the batch.
    return tl.load(qsl_ptr + seq) // block_q + seq


@triton.jit
def _find_seq(qsl_ptr, pid, first_seq, num_seqs, block_q):
    # the last sequence in [first_seq, num_seqs) whose first program id is <= pid
    base = _q_block_start(qsl_ptr, first_seq, block_q)
    lo = first_seq
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if _q_block_start(qsl_ptr, mid, block_q) - base <= pid:
            lo = mid
        else:
            hi = mid
    return lo, _q_block_start(qsl_ptr, lo, block_q) - base


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALE: tl.constexpr):
    # KV_SCALE: 0 none, 1 per tensor, 2 per KV head
    if KV_SCALE == 0:
        return 1.0, 1.0
    off = kv_head if KV_SCALE == 2 else 0
    return tl.load(k_scale_ptr + off), tl.load(v_scale_ptr + off)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start_n, kv_end, qk_scale,
    allowed_end,  # [BLOCK_M] key positions < allowed_end are visible to each row
    allowed_start,  # [BLOCK_M] ... and those >= allowed_start (a sliding window's first key)
    kv_head, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    # one online-softmax step over keys [start_n, start_n + BLOCK_N) of one KV head;
    # MASKED=False: every key of the tile is visible to every row (no causal or length mask)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    n_ok = offs_n < kv_end
    page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    kv_off = page * stride_cb + (offs_n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # fp8 storage: upcast to the query's dtype for the tensor cores
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = ((offs_n[None, :] < allowed_end[:, None]) & n_ok[None, :]
                   & (offs_n[None, :] >= allowed_start[:, None]))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # NOTE: a row with nothing visible yet keeps m = -inf; guard so exp2 sees no (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# NOTE: ints equal to 1 would be specialized into constants, which breaks the while loop's
# carried types in _find_seq.
@triton.jit(do_not_specialize=["first_seq", "num_seqs"])
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs] cached + new tokens
    qsl_ptr,  # [num_seqs + 1] query start offsets
    k_scale_ptr, v_scale_ptr,
    sm_scale, first_seq, num_seqs, group, block_q,
    window,  # a query at p sees keys p - window + 1 .. p (NO_WINDOW: every earlier key)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (query blocks of sequences [first_seq, num_seqs), num_kv_heads). One program
    # attends block_q query tokens x the `group` query heads of one KV head: BLOCK_M rows
    # (token-major), so each K/V tile is loaded once for the whole query group.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, seq_first_pid = _find_seq(qsl_ptr, pid, first_seq, num_seqs, block_q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - seq_first_pid
    if q_block * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    q_tok = q_block * block_q + offs_m // group  # token index within the sequence
    head = kv_head * group + offs_m % group
    row_ok = (offs_m < block_q * group) & (q_tok < q_len)
    q_off = (q_start + q_tok) * stride_qt + head * stride_qh
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALE)
    qk_scale = sm_scale * LOG2E * k_scale
    # bottom-right causal: query token j sits at position context_len + j
    allowed_end = context_len + q_tok + 1
    allowed_start = allowed_end - window
    kv_end = context_len + tl.minimum((q_block + 1) * block_q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys before the block's first query position are visible to all its rows: those tiles
    # skip the mask; only the tiles on the diagonal pay for it
    unmasked_end = (context_len + q_block * block_q + 1) // BLOCK_N * BLOCK_N
    # NOTE: with a window, tiles before the first row's window are skipped and every tile
    # left is masked (the rows' windows start at different keys)
    first_key = tl.maximum(context_len + q_block * block_q + 1 - window, 0)
    lo = first_key // BLOCK_N * BLOCK_N
    unwindowed = (window >= NO_WINDOW).to(tl.int32)
    unmasked_end = lo + (unmasked_end - lo) * unwindowed
    for start_n in range(lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start_n, kv_end, qk_scale,
            allowed_end, allowed_start, kv_head, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, HEAD_DIM_P2, PAGE_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, False,
        )
    for start_n in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start_n, kv_end, qk_scale,
            allowed_end, allowed_start, kv_head, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, HEAD_DIM_P2, PAGE_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, True,
        )
    l_i = tl.where(row_ok, l_i, 1.0)
    out = acc * (v_scale / l_i)[:, None]
    o_off = (q_start + q_tok) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


@triton.jit
def decode_kernel(
    out_ptr,  # [num_decodes, num_heads, head_dim] (final output when not SPLIT)
    part_out_ptr,  # [num_decodes, num_heads, num_splits, head_dim] fp32 (SPLIT)
    part_lse_ptr,  # [num_decodes, num_heads, num_splits] fp32, log2 domain (SPLIT)
    q_ptr,  # [num_decodes, num_heads, head_dim]: decode i's one query token is row i
    k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, group, split_len, num_splits,
    window,  # the query (at seq_len - 1) sees the last `window` keys
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    # grid: (num_decodes, num_kv_heads, num_splits); split s covers keys
    # [s * split_len, (s + 1) * split_len) of the sequence; rows are the query group.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_end = tl.minimum(split * split_len + split_len, seq_len)
    # NOTE: a split before the window is empty; the window's first split starts mid-way
    kv_start = tl.maximum(split * split_len, seq_len - window)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    head = kv_head * group + offs_m
    row_ok = offs_m < group
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALE)
    qk_scale = sm_scale * LOG2E * k_scale
    allowed_end = tl.full([BLOCK_M], 0, tl.int32) + seq_len
    allowed_start = allowed_end - window
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start_n, kv_end, qk_scale,
            allowed_end, allowed_start, kv_head, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, HEAD_DIM_P2, PAGE_SIZE, BLOCK_N, UPCAST, DOT_PRECISION, True,
        )
    empty = l_i == 0.0  # a split past the end of a short sequence
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    if SPLIT:
        part = (seq * (group * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    else:
        o_off = seq * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=q_mask)


@triton.jit
def decode_reduce_kernel(
    out_ptr,  # [num_decodes, num_heads, head_dim]
    part_out_ptr,  # [num_decodes, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_decodes, num_heads, num_splits] fp32
    num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    # grid: (num_decodes, num_heads); merges the splits' partial softmaxes by their lse
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    mask = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM
                    + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
