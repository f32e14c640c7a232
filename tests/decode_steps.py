"""Hand-built decode steps for the fused decode stack's tests (tests/engine): a batch's
metadata, random KV state and one forward pass under a forward context. A plain module, as
tiny_llama.py."""

from __future__ import annotations

import torch

from engine.models.forward_context import ForwardContext, forward_context
from kernels import AttentionMetadata
from kernels.attention import cpu_backend


def decode_batch(lens: list[int], query_lens: list[int], block_size: int, gen: torch.Generator):
    """Token ids, positions and metadata of sequences of `lens` tokens (the new ones
    included), each in its own blocks, the last query_lens[i] tokens new."""
    per = [-(-n // block_size) for n in lens]
    tables = torch.zeros(len(lens), max(per), dtype=torch.int64)  # padded with block 0
    for i, first in enumerate(torch.tensor([1, *per]).cumsum(0)[:-1].tolist()):
        tables[i, : per[i]] = torch.arange(first, first + per[i])
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, query_lens, strict=True)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(query_lens))
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=slots,
        num_decodes=sum(q == 1 for q in query_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=lens, max_decode_seq_len=max(lens))
    ids = torch.randint(100, 49152, (len(positions),), generator=gen)
    return ids, positions, meta


def forward(model, caches, meta, ids, positions, backend=cpu_backend, num_layers=None,
            lora=None):
    """The model's hidden states for one step (lora: the step's LoraBatch, None: none)."""
    with torch.inference_mode(), forward_context(ForwardContext(meta, caches, backend, lora)):
        return model(ids, positions, num_layers=num_layers)


def random_state(runner, gen, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(k.shape, generator=gen).to(dtype),
             torch.randn(v.shape, generator=gen).to(dtype)) for k, v in runner.kv_caches]


def copy_caches(caches):
    return [(k.clone(), v.clone()) for k, v in caches]
