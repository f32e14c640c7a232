"""The per-row LoRA delta: a linear wrapped so that each row group of a step adds its adapter's
B(A x) (scaling folded into B) from the slot tensors, one gather-matmul pair per adapter."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.forward_context import get_forward_context
from kernels.cpu.lora import SlotWeights


class LoraLinear(nn.Module):
    """`base` (dense, packed or quantized: any module of x) plus the step's LoRA deltas."""

    def __init__(self, base: nn.Module, slots: SlotWeights) -> None:
        super().__init__()
        self.base = base
        self.slots = slots  # a [slots, R, in], bt [slots, R, out] (kernels/cpu/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = get_forward_context().lora
        if batch is None:
            return out
        return batch.add_delta(out, x, self.slots)
