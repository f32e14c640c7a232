"""Packed 16-feature tiles for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (csrc/quant_kpacked.c, AVX-512
VNNI, in the one CPU library): kernels/cpu/quant.py's packed entry points dispatch here by type
(`quant._packed_fn`); quant_kpacked.c describes the layout.
"""

from __future__ import annotations

import ctypes

from kernels.cpu import library
from kernels.cpu.ggml_types import Q4_K, Q5_0, Q5_1, Q5_K, Q6_K

TYPES = (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
SUPER_BLOCK = {Q5_0: 32, Q5_1: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}  # weights per block

_error: str | None = None


def available() -> bool:
    """The library is built and this CPU runs the K-quant tiles."""
    global _error
    if not library.available():
        _error = library.build_error()
        return False
    if not library.load().kq_isa_supported():
        _error = "the packed K-quant kernels need AVX-512 VNNI"
        return False
    return True


def build_error() -> str | None:
    return _error


def packs(type_id: int, k: int) -> bool:
    """A type these tiles pack, a width of whole blocks, and a CPU that runs them."""
    return type_id in TYPES and k % SUPER_BLOCK[type_id] == 0 and available()


def function(name: str) -> ctypes._CFuncPtr:
    """kq_<name> (packed_bytes, pack, matmul_packed, packed_rows, packed_kmajor, mlp_packed):
    the same arguments as quant_<name>."""
    if not available():
        raise RuntimeError(f"the packed K-quant kernels cannot run here: {_error}")
    return getattr(library.load(), f"kq_{name}")
