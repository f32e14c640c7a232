"""The one CPU library: its C sources (kernels/cpu/csrc/) with their flags, their exported
signatures for ctypes, and the loader every wrapper shares (built once per process).

A new C source is one line in SOURCES (and its entry points in api.h and SIGNATURES).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from kernels import cc_build

CSRC = Path(__file__).with_name("csrc")
HEADERS = tuple(sorted(CSRC.glob("*.h")))
_BASE = ["-O3", "-fPIC", "-std=gnu11"]
# NOTE: per source: decode attention in fast math for this CPU; the norms and rope with no
# -ffast-math and no FMA contraction (the same IEEE operations as the torch formulas); the
# quantized products without -march, their SIMD paths carrying their own target attributes
# (common.h) so the scalar reference stays portable and paths are chosen at run time.
FAST_NATIVE = [*_BASE, "-march=native", "-ffast-math", "-fopenmp"]
EXACT_NATIVE = [*_BASE, "-march=native", "-ffp-contract=off", "-fopenmp"]
PORTABLE = [*_BASE, "-fopenmp"]
# NOTE: decode.c's vectors are 16 floats with AVX-512 and 8 with AVX2 alone (its attend8),
# registers either way. Elsewhere (baseline x86-64) gcc -O3 spends minutes lowering the 16-float
# ones (68 s; 118 s for -march=haswell before attend8), so -O2 there (5-7 s). With AVX2, -O3
# builds decode.c in 8 s, and -O2 left attend8's per-token loops rolled, their vectors stored
# and reloaded each step: 2.0x slower.
_FLAGS = cc_build.cpu_flags().split()
DECODE = FAST_NATIVE if "avx512f" in _FLAGS or "avx2" in _FLAGS else [*FAST_NATIVE, "-O2"]
SOURCES: tuple[tuple[str, list[str]], ...] = (
    ("decode.c", DECODE),  # paged decode attention, KV writes
    ("ops.c", EXACT_NATIVE),  # add + RMSNorm, rope, argmax
    ("quant.c", PORTABLE),  # quantized products: entry points, ISA dispatch
    ("quant_ref.c", PORTABLE),  # scalar reference
    ("quant_x86.c", PORTABLE),  # AVX2 / AVX-512 row tiles
    ("quant_packed.c", PORTABLE),  # 16-feature packed tiles
    ("mlp.c", PORTABLE),  # the one-call MLP over packed tiles
    ("mlp_blocks.c", PORTABLE),  # multi-part products and the one-call MLP over raw blocks
    ("quant_kpacked.c", PORTABLE),  # packed tiles of Q5_0, Q5_1 and the K-quants
    ("lora.c", PORTABLE),  # per-row LoRA deltas
    ("fused.c", _BASE),  # a decode step's decoder stack, calling the kernels above
)

_i64, _i32, _f32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_DECODE = [_p, _i64, _p, _p, _p, _i64, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _f32, _i32,
           _i32]
_WRITE_KV = [_p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i64]
# name -> (argtypes, restype), as api.h declares them
SIGNATURES: dict[str, tuple[list, type | None]] = {
    "paged_decode_f32": (_DECODE, None),
    "paged_decode_f16": (_DECODE, None),
    "write_kv_f32": (_WRITE_KV, _i64),
    "write_kv_f16": (_WRITE_KV, _i64),
    "half_bits_to_float_n": ([_p, _p, _i64], None),
    "float_to_half_bits_n": ([_p, _p, _i64], None),
    "add_rms_norm_f32": ([_p, _p, _p, _p, _i64, _i64, _f32, _i32], None),
    "rms_norm_heads_f32": ([_p, _i64, _p, _i64, _i64, _i64, _f32, _i32], None),
    "rope_f32": ([_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i32], None),
    "argmax_rows_f32": ([_p, _i64, _i64, _i64, _p, _i32], None),
    "quant_block_elems": ([_i32], _i32),
    "quant_block_bytes": ([_i32], _i32),
    "isa_supported": ([_i32], _i32),
    "best_isa": ([], _i32),
    "quant_matmul": ([_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32, _i32, _i32], _i32),
    "quant_dequant_rows": ([_i32, _p, _i64, _p, _i64, _i64, _i64, _p, _i32, _i32], _i32),
    "quant_packed_bytes": ([_i32, _i64, _i64], _i64),
    "quant_pack": ([_i32, _p, _i64, _i64, _p], _i32),
    "quant_matmul_packed": ([_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32, _i32], _i32),
    "quant_packed_rows": ([_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i32], _i32),
    "quant_packed_kmajor": ([_i32, _p, _i64, _i64, _i64, _i64, _p, _i64, _i32], _i32),
    "quant_mlp_packed": ([_i32, _p, _i32, _p, _i64, _i64, _p, _i64, _p, _i32, _i32, _p, _i32],
                         _i32),
    "quant_matmul_parts": ([_p, _i64, _p, _i64, _i64, _p, _i64, _i32, _i32, _i32], _i32),
    "quant_matmul_packed_parts": ([_p, _i64, _p, _i64, _i64, _p, _i64, _i32, _i32], _i32),
    "quant_mlp_blocks": ([_p, _p, _i64, _i64, _p, _i64, _p, _i32, _i32, _p, _i32, _i32], _i32),
    "kq_isa_supported": ([], _i32),
    "kq_packed_bytes": ([_i32, _i64, _i64], _i64),
    "kq_pack": ([_i32, _p, _i64, _i64, _p], _i32),
    "kq_matmul_packed": ([_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i32, _i32], _i32),
    "kq_packed_rows": ([_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i32], _i32),
    "kq_packed_kmajor": ([_i32, _p, _i64, _i64, _i64, _i64, _p, _i64, _i32], _i32),
    "kq_mlp_packed": ([_i32, _p, _i32, _p, _i64, _i64, _p, _i64, _p, _i32, _i32, _p, _i32],
                      _i32),
    "lora_delta_f32": ([_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _i32,
                        _i32], _i32),
    "fused_decode_stack": ([_p, _p, _i32, _p, _i64, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p,
                            _p, _p, _i32], _i32),
}

_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False


def build(flags: Callable[[list[str]], list[str]] = list) -> ctypes.CDLL:
    """The library built from SOURCES, each source's flags passed through `flags` (a test
    builds a portable variant this way), with SIGNATURES declared; ImportError on a failure."""
    lib = cc_build.build("pagedserve_cpu", [(CSRC / name, flags(f)) for name, f in SOURCES],
                         HEADERS)
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def load() -> ctypes.CDLL:
    """This process's library (built or loaded once); ImportError, every time, when it cannot."""
    global _lib, _error, _tried
    if _lib is not None:  # NOTE: first: the wrappers call this per kernel call
        return _lib
    if not _tried:
        _tried = True
        try:
            _lib = build()
        except ImportError as e:
            _error = str(e)
    if _lib is None:
        raise ImportError(_error)
    return _lib


def build_id() -> str:
    """This process's library build (its cached file's name, which holds the hash of its
    sources, flags, compiler and CPU): what a build writes to disk only the same build reads
    back (engine/models/tile_store.py's tiles)."""
    return Path(load()._name).stem


def available() -> bool:
    """The library is built and loaded (tried once per process)."""
    try:
        load()
    except ImportError:
        return False
    return True


def build_error() -> str | None:
    """Why the library could not be built (after `available()` said False), else None."""
    return _error
