"""One step's rows grouped by LoRA adapter slot, and the delta they add: its own module so that
the forward context can name it without importing the layers that read the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """One step's token rows grouped by adapter slot; rows without an adapter are absent.
    rows: a slice where the group's tokens are contiguous, else an int64 index tensor."""

    groups: list[tuple[int, slice | torch.Tensor]]

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                  b: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in]; out: [num_tokens, out]; a: [slots, R, in]; b: [slots, out, R]
        for slot, rows in self.groups:
            low = x[rows] @ a[slot].T  # [n, R]
            if isinstance(rows, slice):
                out[rows].addmm_(low, b[slot].T)
            else:
                out.index_add_(0, rows, low @ b[slot].T)
        return out
