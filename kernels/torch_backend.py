"""Pure-torch paged attention: the reference backend, and a fast one on the CPU.

Decode gathers each sequence's blocks with one index_select and runs one 4-D SDPA with the GQA
group as query rows; prefill chunks go sequence by sequence with a bottom-right causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
) -> None:
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attend every query token over its sequence's cached K/V (written before this call)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for i in range(nd, meta.num_seqs):
        start = int(meta.query_start_loc[i])
        end = start + meta.query_lens_cpu[i]
        out[start:end] = _prefill_one(q[start:end], k_cache, v_cache, meta, i, scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, bs, kvh, d]; block_ids: [n, nb] -> [n, nb * bs, kvh, d]
    n, nb = block_ids.shape
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(n, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def _decode(q, k_cache, v_cache, meta, scale):
    nd, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    nb = -(-meta.max_decode_seq_len // block_size)
    tables = meta.block_tables[:nd, :nb]
    k = _gather(k_cache, tables).transpose(1, 2).to(q.dtype)  # [nd, kvh, L, d]
    v = _gather(v_cache, tables).transpose(1, 2).to(q.dtype)
    positions = torch.arange(nb * block_size, device=q.device)
    mask = positions[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
    # NOTE: the GQA group rides as query rows: one 4-D SDPA, no K/V repeat.
    qg = q.view(nd, kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(nd, num_heads, head_dim)


def _prefill_one(q, k_cache, v_cache, meta, i, scale):
    q_len, num_heads, head_dim = q.shape
    seq_len = meta.seq_lens_cpu[i]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    nb = -(-seq_len // block_size)
    tables = meta.block_tables[i : i + 1, :nb]
    k = _gather(k_cache, tables)[0, :seq_len].to(q.dtype)  # [L, kvh, d]
    v = _gather(v_cache, tables)[0, :seq_len].to(q.dtype)
    # [kvh, group * q_len, d]: the group's query rows share each KV head
    qg = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(kv_heads, group * q_len, head_dim)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [kvh, L, d]
    if q_len == seq_len:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril()
    else:
        # NOTE: bottom-right causal: query j (of q_len) sits at position seq_len - q_len + j.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
    mask = mask.repeat(group, 1)  # rows follow qg's (group, q_len) order
    out = F.scaled_dot_product_attention(qg[None], kt[None], vt[None], attn_mask=mask, scale=scale)
    # [1, kvh, group * q_len, d] -> [q_len, num_heads, d]
    return out[0].view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
        q_len, num_heads, head_dim
    )
