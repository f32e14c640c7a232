"""Attention metadata of one flattened varlen batch: decodes first, then prefill chunks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the token stream and where its K/V live.

    Sequences are ordered decodes first (query length 1), then prefill chunks, so the decode
    part is one dense batch.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens of each sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with a valid block id
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token (-1: skip)
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens_cpu: list[int]  # per sequence, on the host (prefill loops use them)
    seq_lens_cpu: list[int]  # per sequence, on the host
    max_decode_seq_len: int = 0  # longest decode sequence: bounds the blocks gathered
    # The attending layer's sliding window W: a query at position p sees keys p-W+1 .. p
    # (W keys, itself included); None: every earlier key. Blocks wholly before the window
    # may be absent from the tables (a valid placeholder id stands in): never read them.
    window: int | None = None
    # prefill tokens attend as their decodes would, where the backend can (the CPU kernel):
    # a token's attention is then the same bits in any batch, chunking or cache state
    invariant: bool = False
    _prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False, compare=False)
    _by_window: dict = field(default_factory=dict, repr=False, compare=False)

    def with_window(self, window: int | None) -> AttentionMetadata:
        """This batch's metadata for a layer with `window` (made once per window and step)."""
        if window == self.window:
            return self
        if window not in self._by_window:
            self._by_window[window] = dataclasses.replace(self, window=window, _by_window={})
        return self._by_window[window]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prefill token as a decode row: (its sequence's block table [tokens, max
        blocks] int64, its position + 1 [tokens] int32). Made once per step: every layer (and
        window) of the step shares it."""
        if self._prefill_rows is None:
            nd = self.num_decodes
            qlens = torch.tensor(self.query_lens_cpu[nd:])
            rows = torch.repeat_interleave(torch.arange(nd, self.num_seqs), qlens)
            last = torch.tensor(self.seq_lens_cpu[nd:])  # each chunk's last position + 1
            ends = qlens.cumsum(0)
            # position + 1 of each token: its chunk's last, less the tokens after it
            lens = last.repeat_interleave(qlens) - (
                ends.repeat_interleave(qlens) - 1 - torch.arange(int(ends[-1])))
            tables = self.block_tables.index_select(0, rows.to(self.block_tables.device))
            self._prefill_rows = (tables, lens.to(torch.int32))
        return self._prefill_rows
