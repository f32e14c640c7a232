"""One step's rows grouped by LoRA adapter slot, and the delta they add: what the layers read of
the step's adapters, through the forward context (engine/run/lora/slots.py builds it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu import lora as cpu_lora
from kernels.cpu.lora import SlotWeights


@dataclass(frozen=True)
class LoraBatch:
    """One step's token rows grouped by adapter slot; rows without an adapter are absent.
    rows: a slice where the group's tokens are contiguous, else an int64 index tensor."""

    groups: list[tuple[int, slice | torch.Tensor]]
    # each token row's slot (-1: no adapter), int32 [num_tokens] on the CPU: the C kernels'
    # form (kernels/cpu/lora.py, the one-call MLP, the decode stack). None: the torch deltas
    # only (off the CPU, or a test's reference).
    row_slots: torch.Tensor | None = None

    def runs_in_c(self, rows: int) -> bool:
        """The C kernels add this step's deltas over `rows` token rows: the row slots are in
        their form, and the adapters have few enough rows each (ROWS_PER_ADAPTER: above,
        torch's products are faster; so decode steps, not prefill chunks)."""
        return (self.row_slots is not None and self.row_slots.numel() == rows
                and rows <= cpu_lora.ROWS_PER_ADAPTER * len(self.groups))

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, w: SlotWeights) -> torch.Tensor:
        """out += each row's B(A x): C on the CPU in float32 where runs_in_c (kernels/cpu/
        lora.py), else the torch reference."""
        if self.runs_in_c(x.shape[0]) and cpu_lora.fits(out, x, w):
            return cpu_lora.add_delta(out, x, self.row_slots, w)
        return self.add_delta_torch(out, x, w)

    def add_delta_torch(self, out: torch.Tensor, x: torch.Tensor,
                        w: SlotWeights) -> torch.Tensor:
        # x: [num_tokens, in]; out: [num_tokens, out]; a: [slots, R, in]; bt: [slots, R, out]
        for slot, rows in self.groups:
            low = x[rows] @ w.a[slot].T  # [n, R]
            if isinstance(rows, slice):
                out[rows].addmm_(low, w.bt[slot])
            else:
                out.index_add_(0, rows, low @ w.bt[slot])
        return out
