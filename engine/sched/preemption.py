"""Swap or recompute: a preempted request's KV is either copied to the CPU pool and back, or
dropped and recomputed. Pick the cheaper by a simple estimate of seconds."""

from __future__ import annotations

from dataclasses import dataclass

SWAP = "swap"
RECOMPUTE = "recompute"

# NOTE: rough rates; only their ratio matters. Host copies here ran at ~5-10 GB/s and fp32
# matmuls at ~200 GFLOP/s (shared/NOTES.md); a Hopper GPU does ~25 GB/s over PCIe (pinned)
# and ~400 TFLOP/s in bf16, so small models recompute faster than they swap there.
_RATES = {"cpu": (5e9, 2e11), "cuda": (2.5e10, 4e14)}  # (copy bytes/s, FLOP/s)


@dataclass
class PreemptionStats:
    swap: int = 0
    recompute: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0


@dataclass(frozen=True)
class PreemptionCost:
    block_bytes: int  # bytes of one block over all layers, K and V
    flops_per_token: float  # about 2 x parameters
    device_type: str
    mode: str = "auto"  # auto | swap | recompute

    def choose(self, num_blocks: int, num_tokens: int, can_swap: bool) -> str:
        if not can_swap or self.mode == RECOMPUTE:
            return RECOMPUTE
        if self.mode == SWAP:
            return SWAP
        copy_rate, flop_rate = _RATES.get(self.device_type, _RATES["cpu"])
        swap_s = 2 * num_blocks * self.block_bytes / copy_rate  # out now, in later
        recompute_s = num_tokens * self.flops_per_token / flop_rate
        return SWAP if swap_s < recompute_s else RECOMPUTE
