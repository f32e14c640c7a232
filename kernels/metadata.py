"""Attention metadata of one flattened varlen batch: decodes first, then prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the token stream and where its K/V live.

    Sequences are ordered decodes first (query length 1), then prefill chunks, so the decode
    part is one dense batch.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens of each sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with a valid block id
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token (-1: skip)
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens_cpu: list[int]  # per sequence, on the host (prefill loops use them)
    seq_lens_cpu: list[int]  # per sequence, on the host
    max_decode_seq_len: int = 0  # longest decode sequence: bounds the blocks gathered

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
