"""Allowed-token bitmasks for the step plan, filled on the scheduler's side from each choice's
grammar matcher (llguidance, imported lazily): one row per plain sampling position, and for a
choice verifying drafts one row per position up to the first draft its grammar refuses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.step_plan import GrammarMask

if TYPE_CHECKING:
    from engine.sched.structured.backend import Matcher


class GrammarMasks:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._masker = None

    def masker(self):
        from engine.sched.structured.backend import Masker  # NOTE: llguidance, lazily

        if self._masker is None:
            self._masker = Masker(self.vocab_size)
        return self._masker

    def plain(self, matchers: Sequence[Matcher]) -> list[GrammarMask]:
        """One row each: the tokens each matcher allows next (filled as one batch)."""
        bitmask = self.masker().bitmask(matchers)
        return [_mask(bitmask[i : i + 1]) for i in range(len(matchers))]

    def with_drafts(self, matcher: Matcher, drafts: list[int]) -> GrammarMask:
        """Rows for the positions after 0, 1, .. valid drafts, where `valid` is how many the
        grammar takes; nothing stays consumed."""
        masker = self.masker()
        valid = matcher.valid_prefix(drafts)
        bitmask = np.empty((valid + 1, masker.words), dtype=np.int32)
        for i in range(valid + 1):
            matcher.fill(bitmask, i)
            if i < valid:
                matcher.accept(drafts[i])
        matcher.rollback(valid)  # NOTE: the kept tokens are consumed again when appended
        return _mask(bitmask)


    def only(self, token: int) -> GrammarMask:
        """One row allowing `token` alone (a closing the budget forces)."""
        bitmask = np.zeros((1, self.masker().words), dtype=np.int32)
        bitmask.view(np.uint32)[0, token // 32] = 1 << (token % 32)
        return _mask(bitmask)


def _mask(bitmask: np.ndarray) -> GrammarMask:
    rows, words = bitmask.shape
    return GrammarMask(rows, words, np.ascontiguousarray(bitmask, dtype="<i4").tobytes())
