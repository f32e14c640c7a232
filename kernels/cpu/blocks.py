"""Products and the one-call MLP over raw GGUF blocks (csrc/mlp_blocks.c): the decode-sized
path where a CPU or a type has no packed tiles (every type on an AVX2-only CPU); and products
over packed tiles of several types (csrc/quant_packed.c's quant_matmul_packed_parts).

A weight is a list of row segments (blocks [rows, row_bytes], ggml type id), each of its own
type, stacked into one matrix: a fused qkv or gate/up of a Q4_K_M file is Q4_K and Q6_K
segments. `BlockProduct` multiplies them in one call (quant.c's quant_matmul per segment,
the best ISA this CPU has, or a forced one: tests); `BlockMLP` is down(act(gate) * up) in
one call, the LoRA deltas of adapted rows included. `PackedPartsProduct` is BlockProduct
over the segments' packed tiles (`PackedSegment`s: kernels/cpu/quant.py's `pack` of each),
AVX-512 VNNI only. kernels/cpu/fused.py's decode stack makes the same C calls.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import library
from kernels.cpu.quant import ACTIVATIONS, ISAS, NUMERICS, TYPE_NAMES, packed_bytes, row_bytes

__all__ = ["MAX_PARTS", "BlockMLP", "BlockParts", "BlockProduct", "PackedPartsProduct",
           "PackedSegment", "takes", "takes_packed"]

MAX_PARTS = 4  # api.h's: the most segments one product holds
_i64, _p = ctypes.c_int64, ctypes.c_void_p

Segment = tuple[torch.Tensor, int]  # blocks [rows, row_bytes] uint8, ggml type id
PackedSegment = tuple[torch.Tensor, int, int]  # packed tiles (1-D uint8), ggml type id, rows


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

    @classmethod
    def of_packed(cls, segments: list[PackedSegment], k: int) -> BlockParts:
        """The C view of packed `segments` (checked: each the packed size of its rows of k
        weights); the caller keeps the tensors alive while C holds the addresses."""
        if not takes_packed(segments, k):
            raise ValueError(f"{len(segments)} packed segments of width {k}: at most "
                             f"{MAX_PARTS} contiguous uint8 tiles, each of its rows' size")
        s = cls()
        for i, (tiles, type_id, rows) in enumerate(segments):
            s.data[i], s.type[i], s.rows[i] = tiles.data_ptr(), type_id, rows
        s.parts = len(segments)
        return s


def takes_packed(segments: list[PackedSegment], k: int) -> bool:
    """These packed segments fit one BlockParts."""
    return 0 < len(segments) <= MAX_PARTS and all(
        t in TYPE_NAMES and p.dtype == torch.uint8 and p.dim() == 1 and p.is_contiguous()
        and rows > 0 and p.numel() == packed_bytes(t, rows, k) for p, t, rows in segments)


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


class PackedPartsProduct:
    """x @ W^T for W the stacked packed segments (one packed product per segment, each of its
    type's kernels), its checks done once (the per-token call)."""

    def __init__(self, segments: list[PackedSegment], k: int, numerics: str) -> None:
        self._parts = BlockParts.of_packed(segments, k)
        self._keep = segments  # NOTE: the struct holds their raw addresses
        self.n, self.k = sum(rows for _, _, rows in segments), k
        self._numerics = NUMERICS[numerics]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x float32 [M, k] and out float32 [M, n], both contiguous (not checked), M >= 1."""
        if library.load().quant_matmul_packed_parts(
                ctypes.byref(self._parts), self.k, x.data_ptr(), self.k, x.shape[0],
                out.data_ptr(), self.n, self._numerics, torch.get_num_threads()):
            raise RuntimeError("quant_matmul_packed_parts failed")


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
