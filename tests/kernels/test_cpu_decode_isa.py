"""csrc/decode.c's vector attend is chosen when the library is built for this CPU: attend16
(16-float vectors) with AVX-512, attend8 (8-float vectors) with AVX2 alone. The machine's own
build runs one of them through the other tests; here decode.c is also built alone for AVX2
without AVX-512 (`-march=x86-64-v3`), so attend8 is checked against float64 on an AVX-512
machine too, over both cache dtypes, every group it has an instance for, split-KV and windows
that start mid-block."""

from __future__ import annotations

import ctypes
import math

import c_build
import pytest
import torch
from kernel_cases import TOLERANCES, make_batch, reference

from kernels import cc_build
from kernels.cpu import library

try:
    from kernels.attention import cpu_backend
except ImportError as e:
    cpu_backend, BUILD_ERROR = None, str(e)
else:
    BUILD_ERROR = None

ATOL, RTOL = TOLERANCES[torch.float32]  # float16 K/V: the reference reads the same halves
_ENTRY = {torch.float32: "paged_decode_f32", torch.float16: "paged_decode_f16"}


@pytest.fixture(scope="module")
def avx2_decode() -> ctypes.CDLL:
    """decode.c alone, built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512): attend8."""
    c_build.require(BUILD_ERROR)
    c_build.require_isa("avx2", c_build.CPUINFO_FLAGS["avx2"] <= (c_build.cpu_flags() or set()))
    flags = [f for f in library.FAST_NATIVE if not f.startswith("-march")] + ["-march=x86-64-v3"]
    try:
        lib = cc_build.build("decode_avx2", [(library.CSRC / "decode.c", flags)],
                             library.HEADERS)
    except ImportError as e:
        c_build.require(str(e))
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = library.SIGNATURES[name]
    return lib


def _check(lib: ctypes.CDLL, seqs, group: int, head_dim: int, kv_dtype: torch.dtype,
           num_threads: int, window: int | None = None, page: int = 16, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(group * 100 + head_dim + num_threads + (window or 0))
    b = make_batch(seqs, kv_heads=kv_heads, group=group, head_dim=head_dim,
                   dtype=torch.float32, kv_dtype=kv_dtype, scales=None, page=page,
                   device="cpu", gen=gen, window=window)
    cpu_backend.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = torch.full_like(b.q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    t = b.meta.block_tables
    getattr(lib, _ENTRY[kv_dtype])(
        b.q.data_ptr(), b.q.stride(0), b.k_cache.data_ptr(), b.v_cache.data_ptr(),
        t.data_ptr(), t.stride(0), b.meta.seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
        len(seqs), kv_heads * group, kv_heads, head_dim, page, scale, window or 0, num_threads)
    torch.testing.assert_close(out.double(), reference(b, scale), atol=ATOL, rtol=RTOL)


# chunks of 8 tokens: sequences of 1, 7, 8, 9, 16, 17 and long ones, blocks of 16 and of 8
DECODES = [(0, 1), (6, 1), (7, 1), (8, 1), (15, 1), (16, 1), (300, 1), (130, 1)]


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", range(1, 9))
def test_attend8_matches_float64(avx2_decode, group, head_dim, kv_dtype):
    _check(avx2_decode, DECODES, group, head_dim, kv_dtype, num_threads=2)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attend8_head_dim_256_matches_float64(avx2_decode, group, kv_dtype):
    """Gemma 2 and 3's heads: one KV head (270M, 1B: 4 query heads each) or several (2 each)."""
    _check(avx2_decode, DECODES, group, 256, kv_dtype, num_threads=2,
           kv_heads=1 if group == 4 else 2)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize(("seqs", "num_threads"), [([(2100, 1)], 2), ([(600, 1), (3, 1)], 8),
                                                   ([(700, 1)], 1)])
def test_attend8_split_kv_matches_float64(avx2_decode, seqs, num_threads, kv_dtype):
    _check(avx2_decode, seqs, 3, 64, kv_dtype, num_threads)


@pytest.mark.parametrize("window", [1, 5, 17, 100, 1000])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_attend8_windows_match_float64(avx2_decode, window, head_dim):
    _check(avx2_decode, [(40, 1), (16, 1), (0, 1), (70, 1), (250, 1)], 4, head_dim,
           torch.float16, num_threads=2, window=window)


def test_attend8_pages_of_8_and_32(avx2_decode):
    _check(avx2_decode, DECODES, 3, 64, torch.float16, num_threads=2, page=8)
    _check(avx2_decode, DECODES, 2, 64, torch.float32, num_threads=2, page=32)


def test_attend8_other_shapes_take_the_scalar_attend(avx2_decode):
    _check(avx2_decode, DECODES, 3, 32, torch.float16, num_threads=2)
    _check(avx2_decode, DECODES, 12, 64, torch.float32, num_threads=2)
    _check(avx2_decode, DECODES, 3, 256, torch.float16, num_threads=2)
