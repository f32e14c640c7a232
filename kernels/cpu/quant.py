"""Products and row gathers with GGUF-quantized weights on the CPU (csrc/quant*.c, mlp.c).

Weights stay in their file's blocks: a uint8 tensor [N, row_bytes] per matrix (row n holds
the K weights of output feature n as K / block_elems blocks). `matmul` computes x @ W^T with
one of two numerics, `a32` (weights expanded to float32 in registers, float32 FMA) or `a8`
(activations quantized to int8 per 32 values, integer dot products: llama.cpp's method);
`dequantize_rows` expands chosen rows (the embedding's gather, prefill tiles). Q4_0, Q4_1 and
Q8_0 matrices can also be repacked once (`pack`) into tiles of 16 interleaved output features
(same bytes) for the AVX-512 VNNI kernels `packed_matmul`, `packed_rows`, `packed_kmajor`;
csrc/quant_packed.c describes the layout; Q5_0, Q5_1, Q4_K, Q5_K and Q6_K pack into
csrc/quant_kpacked.c's tiles through the same functions (dispatched by type, kquant.py).
The ISA path is chosen at run time (AVX-512 VNNI, AVX2, scalar) unless a caller forces one.
Part of the one CPU library (kernels/cpu/library.py), these sources are compiled without
-march=native: the SIMD paths carry their own target attributes (csrc/common.h), so the
scalar path stays portable. The OpenMP runtime is the libgomp torch loaded.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import kquant, library
from kernels.cpu.ggml_types import BLOCKS, PACKED_TYPES, TYPE_NAMES
from kernels.cpu.library import available, build_error

__all__ = ["ACTIVATIONS", "BLOCKS", "ISAS", "NUMERICS", "PACKED_TYPES", "TYPE_NAMES",
           "PackedMLP", "PackedProduct", "available", "best_isa", "build_error",
           "dequantize_rows", "isa_supported", "matmul", "pack", "packed_kmajor",
           "packed_bytes", "packed_matmul", "packed_rows", "packs", "row_bytes"]

ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
NUMERICS = {"a32": 0, "a8": 1}


def _library() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"the CPU library could not be built (is a C compiler installed?): "
                           f"{build_error()}")
    return library.load()


def isa_supported(isa: str) -> bool:
    return bool(_library().isa_supported(ISAS[isa]))


def best_isa() -> str:
    return {v: k for k, v in ISAS.items()}[_library().best_isa()]


def row_bytes(type_id: int, k: int) -> int:
    elems, nbytes = BLOCKS[type_id]
    if k % elems:
        raise ValueError(f"{TYPE_NAMES[type_id]} rows hold multiples of {elems} weights, not {k}")
    return k // elems * nbytes


def matmul(x: torch.Tensor, blocks: torch.Tensor, type_id: int, k: int, numerics: str = "a32",
           isa: str = "auto", out: torch.Tensor | None = None,
           num_threads: int | None = None) -> torch.Tensor:
    """x [M, k] float32 (rows contiguous) @ W^T -> [M, N] float32; W is `blocks` [N, bytes]."""
    lib = _library()
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor")
    n = blocks.shape[0]
    if blocks.shape[1] != row_bytes(type_id, k):
        raise ValueError(f"blocks rows hold {blocks.shape[1]} bytes, {TYPE_NAMES[type_id]} x "
                         f"{k} needs {row_bytes(type_id, k)}")
    out = _product_out(x, k, n, out)
    m = x.shape[0]
    if m == 0:
        return out
    rc = lib.quant_matmul(type_id, blocks.data_ptr(), n, k, x.data_ptr(), x.stride(0), m,
                          out.data_ptr(), out.stride(0), NUMERICS[numerics], ISAS[isa],
                          num_threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"quant_matmul failed ({TYPE_NAMES[type_id]}, isa {isa})")
    return out


def _product_out(x: torch.Tensor, k: int, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """Check a product's input x [M, k] and output [M, n] (float32, contiguous rows); the
    output, allocated when None."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be float32 [M, {k}] with contiguous rows")
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    if out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{m}, {n}] with contiguous rows")
    return out


def dequantize_rows(blocks: torch.Tensor, type_id: int, k: int, ids: torch.Tensor | None = None,
                    first: int = 0, count: int | None = None, isa: str = "auto",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [len(ids) or count, k]: the rows `ids` (int64) of W, or rows first..first+count."""
    lib = _library()
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor")
    if blocks.shape[1] != row_bytes(type_id, k):
        raise ValueError(f"blocks rows hold {blocks.shape[1]} bytes, not {row_bytes(type_id, k)}")
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        count = ids.numel()
    elif count is None:
        count = blocks.shape[0] - first
    if out is None:
        out = torch.empty(count, k, dtype=torch.float32)
    if out.shape != (count, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{count}, {k}]")
    rc = lib.quant_dequant_rows(type_id, blocks.data_ptr(), k,
                                None if ids is None else ids.data_ptr(), first, count,
                                blocks.shape[0], out.data_ptr(), ISAS[isa],
                                torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"row ids out of range [0, {blocks.shape[0]})")
    if rc:
        raise RuntimeError(f"quant_dequant_rows failed ({TYPE_NAMES[type_id]}, isa {isa})")
    return out


def packs(type_id: int, k: int) -> bool:
    """`pack` takes this type and width, and this CPU runs the packed kernels."""
    if type_id in kquant.TYPES:
        return kquant.packs(type_id, k)
    return type_id in PACKED_TYPES and k % 32 == 0 and isa_supported("avx512")


def _packed_fn(type_id: int, name: str):
    """The packed entry point `name` for this type: csrc/quant_packed.c's quant_<name>, or for the
    types of csrc/quant_kpacked.c its kq_<name> (same arguments)."""
    if type_id in kquant.TYPES:
        return kquant.function(name)
    return getattr(_library(), f"quant_{name}")


def fuses(gate_up_type: int, down_type: int) -> bool:
    """PackedMLP takes this pair: both types packed by the same library."""
    return (gate_up_type in kquant.TYPES) == (down_type in kquant.TYPES)


def pack(blocks: torch.Tensor, type_id: int, k: int,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Raw blocks [N, row_bytes] -> packed tiles, a 1-D uint8 tensor of the same size (N
    rounded up to 16 features): `out` (contiguous uint8, packed_bytes long) or a new one."""
    _library()
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor")
    n = blocks.shape[0]
    if not packs(type_id, k) or blocks.shape[1] != row_bytes(type_id, k):
        raise ValueError(f"cannot pack {TYPE_NAMES.get(type_id, type_id)} blocks of width {k}")
    size = packed_bytes(type_id, n, k)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size:
        raise ValueError(f"out must be a contiguous uint8 tensor of {size} bytes")
    if _packed_fn(type_id, "pack")(type_id, blocks.data_ptr(), n, k, out.data_ptr()):
        raise RuntimeError("quant_pack failed")
    return out


def packed_bytes(type_id: int, n: int, k: int) -> int:
    """The bytes of a packed [n, k] W of this type (`pack`'s output); negative for a shape or
    type the packed kernels do not take."""
    return _packed_fn(type_id, "packed_bytes")(type_id, n, k)


def _check_packed(packed: torch.Tensor, type_id: int, n: int, k: int) -> None:
    if packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError("packed must be a contiguous uint8 tensor")
    if packed.numel() != packed_bytes(type_id, n, k):
        raise ValueError(f"packed holds {packed.numel()} bytes, not a packed "
                         f"{TYPE_NAMES.get(type_id, type_id)} [{n}, {k}]")


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, type_id: int, n: int, k: int,
                  numerics: str = "a32", out: torch.Tensor | None = None,
                  num_threads: int | None = None) -> torch.Tensor:
    """x [M, k] float32 (rows contiguous) @ W^T -> [M, n], W packed by `pack`."""
    _check_packed(packed, type_id, n, k)
    out = _product_out(x, k, n, out)
    m = x.shape[0]
    if m == 0:
        return out
    rc = _packed_fn(type_id, "matmul_packed")(
        type_id, packed.data_ptr(), n, k, x.data_ptr(), x.stride(0), m, out.data_ptr(),
        out.stride(0), NUMERICS[numerics], num_threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"quant_matmul_packed failed ({TYPE_NAMES[type_id]})")
    return out


class PackedProduct:
    """x @ W^T for one packed W, its checks done once: the per-token call of a decode step
    (NOTE: 8-10 us of Python and ctypes per product otherwise, 121 products per token on
    SmolLM2-135M)."""

    def __init__(self, packed: torch.Tensor, type_id: int, n: int, k: int,
                 numerics: str) -> None:
        _check_packed(packed, type_id, n, k)
        self.packed, self.n, self.k = packed, n, k  # NOTE: keeps the tiles alive
        self._fn = _packed_fn(type_id, "matmul_packed")
        self._head = (type_id, packed.data_ptr(), n, k)
        self._numerics = NUMERICS[numerics]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x float32 [M, k] and out float32 [M, n], both contiguous (not checked)."""
        if self._fn(*self._head, x.data_ptr(), self.k, x.shape[0], out.data_ptr(), self.n,
                    self._numerics, torch.get_num_threads()):
            raise RuntimeError("quant_matmul_packed failed")


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class PackedMLP:
    """down(act(gate) * up) in one call (one OpenMP region; C's vectorized exp for the
    activation, about 1 ulp from torch's): gate_up packed [2 * inter, hidden] with the gate's
    features first, down packed [hidden, inter]."""

    def __init__(self, gate_up: torch.Tensor, gate_up_type: int, down: torch.Tensor,
                 down_type: int, hidden: int, inter: int, numerics: str, act: str) -> None:
        _check_packed(gate_up, gate_up_type, 2 * inter, hidden)
        _check_packed(down, down_type, hidden, inter)
        self.tensors = (gate_up, down)  # NOTE: keeps the tiles alive
        self.hidden = hidden
        if not fuses(gate_up_type, down_type):
            raise ValueError(f"no one-call MLP for {TYPE_NAMES[gate_up_type]} gate/up with "
                             f"{TYPE_NAMES[down_type]} down")
        self._fn = _packed_fn(gate_up_type, "mlp_packed")
        self._head = (gate_up_type, gate_up.data_ptr(), down_type, down.data_ptr(), inter,
                      hidden)
        self._tail = (NUMERICS[numerics], ACTIVATIONS[act])

    def __call__(self, x: torch.Tensor, out: torch.Tensor, lora: int | None = None) -> None:
        """x and out float32 [M, hidden], contiguous (not checked), M >= 1. lora: the address
        of an api.h MlpLora whose deltas to add (kernels/cpu/lora.py's MlpDeltas), or None."""
        if self._fn(*self._head, x.data_ptr(), x.shape[0], out.data_ptr(), *self._tail, lora,
                    torch.get_num_threads()):
            raise RuntimeError("quant_mlp_packed failed")


def packed_rows(packed: torch.Tensor, type_id: int, n: int, k: int,
                ids: torch.Tensor | None = None, first: int = 0,
                count: int | None = None) -> torch.Tensor:
    """float32 [len(ids) or count, k]: features `ids` (or first..first+count) of a packed W."""
    _check_packed(packed, type_id, n, k)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        count = ids.numel()
    elif count is None:
        count = n - first
    out = torch.empty(count, k, dtype=torch.float32)
    rc = _packed_fn(type_id, "packed_rows")(type_id, packed.data_ptr(), n, k,
                                None if ids is None else ids.data_ptr(), first, count,
                                out.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"row ids out of range [0, {n})")
    if rc:
        raise RuntimeError(f"quant_packed_rows failed ({TYPE_NAMES[type_id]})")
    return out


def packed_kmajor(packed: torch.Tensor, type_id: int, n: int, k: int, first_tile: int,
                  end_tile: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [k, 16 * (end_tile - first_tile)]: W^T for the features of tiles
    first_tile..end_tile (16 each; features past n are zeros), for a GEMM x @ it."""
    _check_packed(packed, type_id, n, k)
    cols = 16 * (end_tile - first_tile)
    if out is None:
        out = torch.empty(k, cols, dtype=torch.float32)
    if out.shape != (k, cols) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{k}, {cols}] with contiguous rows")
    rc = _packed_fn(type_id, "packed_kmajor")(type_id, packed.data_ptr(), n, k, first_tile,
                                              end_tile, out.data_ptr(), out.stride(0),
                                              torch.get_num_threads())
    if rc:
        raise RuntimeError(f"quant_packed_kmajor failed ({TYPE_NAMES[type_id]})")
    return out
