"""The runner's persistent state per choice (row): tokens, block table, progress, sampling
parameters and seeded generator, kept across steps and updated from the step plan's entries."""

from __future__ import annotations

import numpy as np
import torch

from engine.step_plan import Diff, NewRequest, StepPlan
from ipc.sampling import SamplingParams


class Row:
    """One choice as the runner and sampler see it (the sampler reads only these fields)."""

    def __init__(self, new: NewRequest, slot: int, generator: torch.Generator | None) -> None:
        self.key = new.key
        self.slot = slot  # its row in RowStates.block_table
        self.token_ids = list(new.token_ids)  # prompt + output tokens the scheduler sent
        self.num_prompt_tokens = new.num_prompt_tokens
        self.sampling: SamplingParams = new.sampling
        self.generator = generator  # its own (seeded) generator, or None: the shared one
        self.num_computed_tokens = new.num_computed_tokens
        self.end_token_ids = new.end_token_ids  # EOS and stop_token_ids unless ignore_eos
        self.lora = new.lora  # its LoRA adapter's id, None: the base model
        self.num_blocks = 0  # entries of its block table
        # this step's: the drafts it verifies, their draft probabilities ([gamma, vocab],
        # None for a one-hot draft), and its grammar's int32 bitmask [rows, words]
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        self.grammar_mask: np.ndarray | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RowStates:
    """Rows by key, and one block-table array (a row per slot) that plan diffs edit in place."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device) -> None:
        self.rows: dict[str, Row] = {}
        self.device = device
        # NOTE: NULL_BLOCK entries (released behind a sliding window) are stored as block 0:
        # a valid id, always masked out
        self.block_table = np.zeros((16, max_blocks_per_seq), dtype=np.int64)
        self._free_slots = list(range(15, -1, -1))
        self.applied_step = 0  # the last plan whose entries were applied

    def apply(self, plan: StepPlan) -> None:
        """Take the plan's entries once: drop finished rows, add new ones, apply diffs."""
        if plan.step == self.applied_step:
            return
        self.applied_step = plan.step
        for key in plan.finished_keys:
            row = self.rows.pop(key, None)
            if row is not None:
                self._free_slots.append(row.slot)
        for new in plan.new_requests:
            row = Row(new, self._take_slot(), self._generator(new.seed))
            self.rows[new.key] = row
            self._write_table(row, Diff(0, new.block_ids))
        for cached in plan.cached_requests:
            row = self.rows[cached.key]
            if cached.tokens is not None:
                del row.token_ids[cached.tokens.start :]
                row.token_ids.extend(cached.tokens.values)
            if cached.block_ids is not None:
                self._write_table(row, cached.block_ids)
            row.num_computed_tokens = cached.num_computed_tokens
        for row in self.rows.values():
            row.spec_token_ids, row.spec_draft_probs, row.grammar_mask = [], None, None

    def set_step_inputs(self, plan: StepPlan) -> None:
        """This step's drafts and grammar masks (known once the drafts are attached)."""
        for key, drafts in plan.spec_token_ids.items():
            self.rows[key].spec_token_ids = drafts
        for key, mask in plan.grammar_masks.items():
            bits = np.frombuffer(mask.data, dtype="<i4").reshape(mask.rows, mask.words)
            self.rows[key].grammar_mask = bits

    def tables(self, rows: list[Row], max_blocks: int) -> np.ndarray:
        """[len(rows), max_blocks] block tables of these rows (a gathered copy)."""
        return self.block_table[[r.slot for r in rows], :max_blocks]

    def _write_table(self, row: Row, diff: Diff) -> None:
        end = diff.start + len(diff.values)
        if diff.values:
            self.block_table[row.slot, diff.start : end] = np.maximum(diff.values, 0)
        if end < row.num_blocks:
            self.block_table[row.slot, end : row.num_blocks] = 0
        row.num_blocks = end

    def _take_slot(self) -> int:
        if not self._free_slots:
            n = len(self.block_table)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        slot = self._free_slots.pop()
        self.block_table[slot] = 0
        return slot

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)
