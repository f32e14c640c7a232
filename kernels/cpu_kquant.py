"""Packed 16-feature tiles for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (kernels/cpu_kquant.c, AVX-512
VNNI): the library behind kernels/cpu_quant.py's packed entry points for these types, which
dispatch here by type (`cpu_quant._packed_fn`); cpu_kquant.c describes the layout.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kquant.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=gnu11"]
TYPES = (6, 7, 12, 13, 14)  # Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
SUPER_BLOCK = {6: 32, 7: 32, 12: 256, 13: 256, 14: 256}  # weights per block (the K width unit)

_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def available() -> bool:
    """The library is built and loaded and this CPU runs it (tried once per process)."""
    global _lib, _tried, _error
    if not _tried:
        _tried = True
        from kernels import cc_build

        try:
            lib = cc_build.build(SOURCE, FLAGS)
        except ImportError as e:
            _error = str(e)
            return False
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.kq_packed_bytes.argtypes = [i32, i64, i64]
        lib.kq_packed_bytes.restype = i64
        lib.kq_pack.argtypes = [i32, ptr, i64, i64, ptr]
        lib.kq_matmul_packed.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32, i32]
        lib.kq_packed_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i32]
        lib.kq_packed_kmajor.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, i64, i32]
        lib.kq_mlp_packed.argtypes = [i32, ptr, i32, ptr, i64, i64, ptr, i64, ptr, i32, i32, i32]
        for f in (lib.kq_pack, lib.kq_matmul_packed, lib.kq_packed_rows, lib.kq_packed_kmajor,
                  lib.kq_mlp_packed, lib.kq_isa_supported):
            f.restype = i32
        if not lib.kq_isa_supported():
            _error = "the packed K-quant kernels need AVX-512 VNNI"
            return False
        _lib = lib
    return _lib is not None


def build_error() -> str | None:
    return _error


def packs(type_id: int, k: int) -> bool:
    """A type this library packs, a width of whole blocks, and a CPU that runs it."""
    return type_id in TYPES and k % SUPER_BLOCK[type_id] == 0 and available()


def function(name: str) -> ctypes._CFuncPtr:
    """The library's kq_<name> (packed_bytes, pack, matmul_packed, packed_rows,
    packed_kmajor, mlp_packed): the same arguments as cpu_quant.c's quant_<name>."""
    if not available():
        raise RuntimeError(f"kernels/cpu_kquant.c cannot run here: {_error}")
    return getattr(_lib, f"kq_{name}")
