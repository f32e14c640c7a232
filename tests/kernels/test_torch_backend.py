"""The torch paged-attention backend against dense causal attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import AttentionMetadata, get_backend

BS, KVH, GROUP, D = 4, 2, 3, 8
H = KVH * GROUP


def dense_reference(q, k, v, context_len):
    """q: [n, H, D] at positions context_len.., k/v: [context_len + n, KVH, D]."""
    n, total = q.shape[0], k.shape[0]
    k = k.repeat_interleave(GROUP, dim=1)
    v = v.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    allowed = torch.arange(total)[None, :] <= (context_len + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_batch(seqs, num_blocks=64):
    """seqs: list of (context_len, query_len); decodes (query_len 1) must come first."""
    torch.manual_seed(0)
    backend = get_backend("torch")
    k_cache = torch.zeros(num_blocks, BS, KVH, D)
    v_cache = torch.zeros(num_blocks, BS, KVH, D)
    free = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, slots, qs, ks, vs, starts = [], [], [], [], [], [0]
    for ctx, n in seqs:
        total = ctx + n
        blocks = [free.pop() for _ in range(-(-total // BS))]
        tables.append(blocks)
        k = torch.randn(total, KVH, D)
        v = torch.randn(total, KVH, D)
        # the cached prefix is already in the cache
        for p in range(ctx):
            k_cache[blocks[p // BS], p % BS] = k[p]
            v_cache[blocks[p // BS], p % BS] = v[p]
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx, total)]
        qs.append(torch.randn(n, H, D))
        ks.append(k)
        vs.append(v)
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        num_decodes=sum(1 for _, n in seqs if n == 1),
        query_lens_cpu=[n for _, n in seqs],
        seq_lens_cpu=[c + n for c, n in seqs],
        max_decode_seq_len=max([c + n for c, n in seqs if n == 1], default=0),
    )
    q = torch.cat(qs)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, seqs, strict=True)])
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = backend.paged_attention(q, k_cache, v_cache, meta, 1 / math.sqrt(D))
    return out, qs, ks, vs


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 7)],  # prefill from scratch
        [(5, 1), (12, 1), (3, 1)],  # decodes only, ragged
        [(9, 1), (0, 5), (6, 3)],  # decode + prefill + chunk after a cached prefix
        [(4, 1), (8, 8)],  # chunk exactly on block boundaries
    ],
)
def test_paged_attention_matches_dense(seqs):
    out, qs, ks, vs = run_batch(seqs)
    start = 0
    for (ctx, n), q, k, v in zip(seqs, qs, ks, vs, strict=True):
        expected = dense_reference(q, k, v, ctx)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


def test_write_kv_skips_padding_slots():
    backend = get_backend("torch")
    k_cache = torch.zeros(2, BS, KVH, D)
    v_cache = torch.zeros(2, BS, KVH, D)
    key = torch.ones(3, KVH, D)
    backend.write_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, KVH, D)
    assert flat[5].eq(1).all() and flat[0].eq(1).all()
    assert flat.abs().sum() == 2 * KVH * D
    assert v_cache.view(-1, KVH, D)[5].eq(2).all()


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="not available"):
        get_backend("no-such-backend")
