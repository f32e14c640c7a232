"""Pure-torch paged attention: the reference backend, and a fast one on the CPU.

Decode gathers each sequence's blocks with one index_select and runs one 4-D SDPA with the GQA
group as query rows; prefill chunks go sequence by sequence with a bottom-right causal mask.
A sliding window (`meta.window`) masks keys older than it; tanh soft-capping of the scores
(Gemma 2) runs the same steps written out, as SDPA has no hook for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.metadata import AttentionMetadata

NAME = "torch"
FUSED_CPU_OPS = False  # the reference: the whole model stays in torch
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0
FLOAT16_MAX = 65504.0  # a float16 cache stores values saturated here (no inf)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    *,
    k_scale: torch.Tensor | None = None,  # [] or [num_kv_heads] fp32: stored = x / scale
    v_scale: torch.Tensor | None = None,
) -> None:
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    _store(k_cache, slot_mapping, key, k_scale)
    _store(v_cache, slot_mapping, value, v_scale)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale) -> None:
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if cache.dtype not in FP8_DTYPES:
        if cache.dtype == torch.float16:  # NOTE: saturated, as kernels/cpu/csrc/decode.c writes
            x = x.clamp(-FLOAT16_MAX, FLOAT16_MAX)
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, x.to(cache.dtype))
        return
    x = x.float()
    if scale is not None:
        x = x / scale.float().view(-1, 1)
    # NOTE: clamp first: out-of-range values saturate (a CUDA cast would give NaN), and
    # index_copy_ has no fp8 kernel on the CPU, so the bytes go through a uint8 view.
    q8 = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache.dtype)
    flat = cache.view(torch.uint8).view(-1, kv_heads, head_dim)
    flat.index_copy_(0, slots, q8.view(torch.uint8))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,  # [] or [num_kv_heads]: cache holds x / scale
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attend every query token over its sequence's cached K/V (written before this call),
    within `meta.window` when the layer has one."""
    out = torch.empty_like(q) if out is None else out
    scales = (k_scale, v_scale)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta, scale, scales, softcap)
    prefills(q, k_cache, v_cache, meta, scale, scales, out, softcap)
    return out


def prefills(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, scales, out,
             softcap: float | None = None) -> None:
    """The prefill chunks (every sequence after the decodes), one by one, into `out`."""
    start = meta.num_decodes  # decodes have one query token each
    for i in range(meta.num_decodes, meta.num_seqs):
        end = start + meta.query_lens_cpu[i]
        out[start:end] = _prefill_one(q[start:end], k_cache, v_cache, meta, i, scale, scales,
                                      softcap)
        start = end


def attention(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None,
              is_causal: bool = False) -> torch.Tensor:
    """SDPA over [..., heads, len, d] (k/v heads may divide q's: GQA), or the same steps
    written out when the scores are soft-capped (HF's order: scale, cap, mask, softmax in
    float32, round to q's dtype, times V)."""
    group = q.shape[-3] // k.shape[-3]
    if softcap is None:
        gqa = {"enable_gqa": True} if group > 1 else {}  # NOTE: query head h -> h // group
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, **gqa)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, bs, kvh, d]; block_ids: [n, nb] -> [n, nb * bs, kvh, d]
    n, nb = block_ids.shape
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(n, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def _upcast(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    # x: [..., kvh, d] from the cache -> dtype, times the per-tensor or per-head scale
    if scale is None:
        return x.to(dtype)
    # NOTE: scale in fp32, then one rounding: a bf16-rounded scale skews a whole head's scores.
    return (x.float() * scale.float().view(-1, 1)).to(dtype)


def decode(q, k_cache, v_cache, meta, scale, scales, softcap: float | None = None):
    """The first len(q) sequences, one query token each: [nd, heads, head_dim]."""
    nd, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    nb = -(-meta.max_decode_seq_len // block_size)
    first = 0  # NOTE: with a window, the blocks before every decode's window are skipped
    if meta.window is not None:
        first = max(0, min(meta.seq_lens_cpu[:nd]) - meta.window) // block_size
    tables = meta.block_tables[:nd, first:nb]
    k = _upcast(_gather(k_cache, tables), q.dtype, scales[0]).transpose(1, 2)  # [nd, kvh, L, d]
    v = _upcast(_gather(v_cache, tables), q.dtype, scales[1]).transpose(1, 2)
    positions = torch.arange(first * block_size, nb * block_size, device=q.device)
    mask = positions[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
    if meta.window is not None:
        mask &= positions[None, :] >= meta.seq_lens[:nd, None] - meta.window
    # NOTE: the GQA group rides as query rows: one 4-D SDPA, no K/V repeat.
    qg = q.view(nd, kv_heads, group, head_dim)
    out = attention(qg, k, v, mask[:, None, None, :], scale, softcap)
    return out.reshape(nd, num_heads, head_dim)


def _prefill_one(q, k_cache, v_cache, meta, i, scale, scales, softcap):
    q_len, num_heads, head_dim = q.shape
    seq_len = meta.seq_lens_cpu[i]
    block_size = k_cache.shape[1]
    nb = -(-seq_len // block_size)
    tables = meta.block_tables[i : i + 1, :nb]
    k = _upcast(_gather(k_cache, tables)[0, :seq_len], q.dtype, scales[0])  # [L, kvh, d]
    v = _upcast(_gather(v_cache, tables)[0, :seq_len], q.dtype, scales[1])
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, len, d]
    window = meta.window if meta.window is not None and meta.window < seq_len else None
    if q_len == seq_len and window is None:
        # NOTE: no cached prefix: top-left and bottom-right causal agree, and is_causal lets
        # the flash kernel skip the masked half.
        out = attention(q4, k4, v4, None, scale, softcap, is_causal=True)
    else:
        # bottom-right causal: query j (of q_len) sits at position seq_len - q_len + j
        ones = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        mask = ones.tril(seq_len - q_len)
        if window is not None:  # and key k > position - window
            mask &= ~ones.tril(seq_len - q_len - window)
        out = attention(q4, k4, v4, mask, scale, softcap)
    return out[0].transpose(0, 1)  # [q_len, num_heads, d]
