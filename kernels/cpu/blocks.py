"""Products and the one-call MLP over raw GGUF blocks (csrc/mlp_blocks.c): the decode-sized
path where a CPU or a type has no packed tiles (every type on an AVX2-only CPU).

A weight is a list of row segments (blocks [rows, row_bytes], ggml type id), each of its own
type, stacked into one matrix: a fused qkv or gate/up of a Q4_K_M file is Q4_K and Q6_K
segments. `BlockProduct` multiplies them in one call (quant.c's quant_matmul per segment,
the best ISA this CPU has, or a forced one: tests); `BlockMLP` is down(act(gate) * up) in
one call, the LoRA deltas of adapted rows included. kernels/cpu/fused.py's decode stack
makes the same C calls.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import library
from kernels.cpu.quant import ACTIVATIONS, ISAS, NUMERICS, TYPE_NAMES, row_bytes

__all__ = ["MAX_PARTS", "BlockMLP", "BlockParts", "BlockProduct", "takes"]

MAX_PARTS = 4  # api.h's: the most segments one product holds
_i64, _p = ctypes.c_int64, ctypes.c_void_p

Segment = tuple[torch.Tensor, int]  # blocks [rows, row_bytes] uint8, ggml type id


class BlockParts(ctypes.Structure):
    """api.h's BlockParts: one matrix's raw-block row segments."""

    _fields_ = [("data", _p * MAX_PARTS), ("type", _i64 * MAX_PARTS), ("rows", _i64 * MAX_PARTS),
                ("parts", _i64)]

    @classmethod
    def of(cls, segments: list[Segment], k: int) -> BlockParts:
        """The C view of `segments` (checked: contiguous uint8 rows of k weights of a type the
        library multiplies); the caller keeps the tensors alive while C holds the addresses."""
        if not takes(segments, k):
            raise ValueError(f"{len(segments)} segments of width {k}: at most {MAX_PARTS} "
                             "contiguous uint8 block tensors of known types")
        s = cls()
        for i, (blocks, type_id) in enumerate(segments):
            s.data[i], s.type[i], s.rows[i] = blocks.data_ptr(), type_id, blocks.shape[0]
        s.parts = len(segments)
        return s


def takes(segments: list[Segment], k: int) -> bool:
    """These segments fit one BlockParts."""
    return 0 < len(segments) <= MAX_PARTS and all(
        t in TYPE_NAMES and b.dtype == torch.uint8 and b.dim() == 2 and b.is_contiguous()
        and b.shape[1] == _row_bytes(t, k) for b, t in segments)


def _row_bytes(type_id: int, k: int) -> int:
    try:
        return row_bytes(type_id, k)
    except ValueError:
        return -1


class BlockProduct:
    """x @ W^T for W the stacked segments, its checks done once (the per-token call)."""

    def __init__(self, segments: list[Segment], k: int, numerics: str,
                 isa: str = "auto") -> None:
        self._parts = BlockParts.of(segments, k)
        self._keep = segments  # NOTE: the struct holds their raw addresses
        self.n, self.k = sum(b.shape[0] for b, _ in segments), k
        self._tail = (NUMERICS[numerics], ISAS[isa])

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x float32 [M, k] and out float32 [M, n], both contiguous (not checked), M >= 1."""
        if library.load().quant_matmul_parts(
                ctypes.byref(self._parts), self.k, x.data_ptr(), self.k, x.shape[0],
                out.data_ptr(), self.n, *self._tail, torch.get_num_threads()):
            raise RuntimeError("quant_matmul_parts failed")


class BlockMLP:
    """down(act(gate) * up) in one call: gate_up's segments stack [2 * inter, hidden] (the
    gate's features first), down's [hidden, inter]; the activation is C's vectorized exp
    (about 1 ulp from torch's), as the packed MLP's."""

    def __init__(self, gate_up: list[Segment], down: list[Segment], hidden: int, inter: int,
                 numerics: str, act: str, isa: str = "auto") -> None:
        if sum(b.shape[0] for b, _ in gate_up) != 2 * inter or sum(
                b.shape[0] for b, _ in down) != hidden:
            raise ValueError(f"gate_up must stack {2 * inter} rows and down {hidden}")
        self.gate_up, self.down = BlockParts.of(gate_up, hidden), BlockParts.of(down, inter)
        self._keep = (gate_up, down)  # NOTE: the structs hold their raw addresses
        self.hidden, self.inter = hidden, inter
        self._numerics = (NUMERICS[numerics], ACTIVATIONS[act])
        self._isa = ISAS[isa]

    def __call__(self, x: torch.Tensor, out: torch.Tensor, lora: int | None = None) -> None:
        """x and out float32 [M, hidden], contiguous (not checked), M >= 1. lora: the address
        of an api.h MlpLora whose deltas to add (kernels/cpu/lora.py's MlpDeltas), or None."""
        if library.load().quant_mlp_blocks(
                ctypes.byref(self.gate_up), ctypes.byref(self.down), self.inter, self.hidden,
                x.data_ptr(), x.shape[0], out.data_ptr(), *self._numerics, lora, self._isa,
                torch.get_num_threads()):
            raise RuntimeError("quant_mlp_blocks failed")
