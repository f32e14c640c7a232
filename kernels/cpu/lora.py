"""Per-row LoRA deltas in C (csrc/lora.c): out[r] += B[s] (A[s] x[r]) for the rows r of each
adapter slot s (rows of slot -1 skipped), each adapter's A and B read once per call; and
api.h's structs that hand the same slots to the one-call MLP and the decode stack.

Slots: a float32 [num_slots, rank, in], contiguous, and bt float32 [num_slots, rank, out] (B
transposed, the adapter's scaling folded in) with contiguous rows; row slots int32 [rows].
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import library
from kernels.cpu.library import available, build_error
from kernels.cpu.quant import ISAS

__all__ = ["ROWS_PER_ADAPTER", "LoraWeights", "MlpDeltas", "SlotWeights", "add_delta",
           "available", "build_error", "fits"]

_i64, _p = ctypes.c_int64, ctypes.c_void_p
# NOTE: up to this many rows per adapter in a call the C kernel beats torch's two products per
# adapter; above, torch's (MKL) wins with one adapter: SmolLM2's shapes, rank 16, 2 threads,
# one adapter: x1.0-1.3 of torch at 16-32 rows, x0.8-1.0 at 64, x0.6-0.9 at 128; four
# adapters: x3.8-6.6 at 16 rows, x1.2-2.7 at 128 (bench notes in bench/RESULTS.md).
ROWS_PER_ADAPTER = 32


class LoraWeights(ctypes.Structure):
    """api.h's LoraWeights: one adapted product's slots (a NULL: not adapted)."""

    _fields_ = [("a", _p), ("bt", _p), ("rank", _i64), ("ldb", _i64)]


class _MlpLora(ctypes.Structure):
    _fields_ = [("slots", _p), ("num_slots", _i64), ("gate_up", LoraWeights),
                ("down", LoraWeights)]


@dataclass(frozen=True)
class SlotWeights:
    """One adapted projection's slots (the layout above)."""

    a: torch.Tensor  # [num_slots, rank, in]
    bt: torch.Tensor  # [num_slots, rank, out]

    def struct(self) -> LoraWeights:
        """The C view (the caller keeps this object alive while C holds the addresses)."""
        return LoraWeights(self.a.data_ptr(), self.bt.data_ptr(), self.a.shape[1],
                           self.bt.stride(1))

    def runs_in_c(self) -> bool:
        a, bt = self.a, self.bt
        return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (a, bt))
                and a.is_contiguous() and a.shape[:2] == bt.shape[:2] and bt.stride(2) == 1
                and bt.stride(1) >= bt.shape[2] and bt.stride(0) == bt.shape[1] * bt.stride(1))


def fits(out: torch.Tensor, x: torch.Tensor, w: SlotWeights) -> bool:
    """The C kernel takes these: 2-D float32 CPU rows with contiguous features, slots that
    match their widths, and the library built."""
    return (available() and x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0]
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(1) == 1
                    for t in (x, out))
            and w.runs_in_c() and w.a.shape[2] == x.shape[1] and w.bt.shape[2] == out.shape[1])


def add_delta(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, w: SlotWeights,
              isa: str = "auto", num_threads: int | None = None) -> torch.Tensor:
    """out [rows, out] += each row's delta of x [rows, in] (fits() holds); row_slots int32
    [rows], -1 for no adapter. isa: "auto" (the best this CPU has) or a forced one (tests)."""
    if row_slots.dtype != torch.int32 or not row_slots.is_contiguous() or (
            row_slots.numel() != x.shape[0]):
        raise ValueError("row_slots must be a contiguous int32 tensor, one per row")
    rc = library.load().lora_delta_f32(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], row_slots.data_ptr(),
        w.a.shape[0], w.a.data_ptr(), w.bt.data_ptr(), w.a.shape[1], w.bt.stride(1),
        out.data_ptr(),
        out.stride(0), out.shape[1], ISAS[isa], num_threads or torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"a LoRA slot out of range (there are {w.a.shape[0]})")
    if rc:
        raise RuntimeError(f"lora_delta_f32 failed (isa {isa})")
    return out


class MlpDeltas:
    """One MLP's adapted gate_up and down for the one-call MLP's `lora` argument (api.h's
    MlpLora), filled once; `address` points it at a step's row slots."""

    def __init__(self, gate_up: SlotWeights, down: SlotWeights) -> None:
        self._keep = (gate_up, down)  # NOTE: the struct holds their raw addresses
        self._struct = _MlpLora(0, gate_up.a.shape[0], gate_up.struct(), down.struct())

    def address(self, row_slots: torch.Tensor) -> int:
        """row_slots int32 [rows] contiguous, kept alive by the caller through the call."""
        self._struct.slots = row_slots.data_ptr()
        return ctypes.addressof(self._struct)
