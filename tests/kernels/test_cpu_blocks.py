"""kernels/cpu/blocks.py (csrc/mlp_blocks.c): products of several raw-block segments of their
own types, and the one-call MLP over them, against float64 of the `gguf` package's
dequantized weights and torch's float64 activations, on every ISA this CPU has (forced); and
the product of such segments packed (csrc/quant_packed.c's quant_matmul_packed_parts).
"""

from __future__ import annotations

import c_build
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.cpu import blocks as cpu_blocks
from kernels.cpu import quant as cpu_quant
from kernels.cpu.ggml_types import Q4_K, Q5_0, Q6_K, Q8_0

ISAS = ["scalar", "avx2", "avx512"]
FP16_AT = {Q5_0: [0], Q8_0: [0], Q4_K: [0, 2], Q6_K: [208]}


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with moderate fp16 scales (the activation's whole range, no overflow)."""
    elems, nbytes = cpu_quant.BLOCKS[type_id]
    b = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in FP16_AT[type_id]:
        scales = rng.uniform(-0.01, 0.01, size=b.shape[:2]).astype(np.float16)
        b[..., off:off + 2] = scales.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(n, -1)


def segments(spec: list[tuple[int, int]], k: int, rng) -> tuple[list, np.ndarray]:
    """(type, rows) segments as blocks, and their stacked float64 weights."""
    blocks = [random_blocks(t, n, k, rng) for t, n in spec]
    w = np.concatenate([dequantize(b, GGMLQuantizationType(t)).astype(np.float64)
                        for b, (t, _) in zip(blocks, spec, strict=True)])
    return [(torch.from_numpy(b), t) for b, (t, _) in zip(blocks, spec, strict=True)], w


@pytest.mark.parametrize("isa", ISAS)
def test_a_product_of_segments_of_three_types_is_the_stacked_matrix(isa: str) -> None:
    """Q4_K, Q6_K and Q8_0 row segments (37 rows in all, none a multiple of 16): a32 within
    K 2^-23 (|W| @ |x|) of float64, a8 within 2e-2 of the output's max."""
    c_build.require_isa(isa, cpu_quant.isa_supported(isa))
    rng = np.random.default_rng(1)
    k = 512
    segs, w = segments([(Q4_K, 19), (Q6_K, 11), (Q8_0, 7)], k, rng)
    for m in (1, 3, 17, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        for numerics in ("a32", "a8"):
            out = torch.empty(m, 37)
            cpu_blocks.BlockProduct(segs, k, numerics, isa)(torch.from_numpy(x), out)
            err = np.abs(out.double().numpy() - ref)
            if numerics == "a32":
                bound = k * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
                assert (err <= bound).all(), f"{isa} a32 M={m}: {err.max():.2e}"
            else:
                assert err.max() <= 2e-2 * np.abs(ref).max(), f"{isa} a8 M={m}"


def test_a_product_of_packed_segments_of_two_libraries_is_the_stacked_matrix() -> None:
    """The same three segments packed (Q4_K and Q6_K in quant_kpacked.c's tiles, Q8_0 in
    quant_packed.c's; AVX-512 VNNI): PackedPartsProduct within the same bounds of float64."""
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))
    rng = np.random.default_rng(1)
    k = 512
    segs, w = segments([(Q4_K, 19), (Q6_K, 11), (Q8_0, 7)], k, rng)
    packed = [(cpu_quant.pack(b, t, k), t, b.shape[0]) for b, t in segs]
    for m in (1, 3, 17, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        for numerics in ("a32", "a8"):
            out = torch.empty(m, 37)
            cpu_blocks.PackedPartsProduct(packed, k, numerics)(torch.from_numpy(x), out)
            err = np.abs(out.double().numpy() - ref)
            if numerics == "a32":
                bound = k * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
                assert (err <= bound).all(), f"a32 M={m}: {err.max():.2e}"
            else:
                assert err.max() <= 2e-2 * np.abs(ref).max(), f"a8 M={m}"


@pytest.mark.parametrize("isa", ISAS)
def test_the_mlp_over_segments_matches_float64(isa: str) -> None:
    """gate Q4_K and up Q6_K stacked (Q4_K_M's mix), down Q5_0 then Q8_0; both activations:
    a32 relative 2e-6 of the output's max, a8 5e-2."""
    c_build.require_isa(isa, cpu_quant.isa_supported(isa))
    rng = np.random.default_rng(2)
    hidden, inter = 256, 512
    gu, wg = segments([(Q4_K, inter), (Q6_K, inter)], hidden, rng)
    dn, wd = segments([(Q5_0, 100), (Q8_0, hidden - 100)], inter, rng)
    acts = {"silu": torch.nn.functional.silu,
            "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}
    for act, fn in acts.items():
        for numerics, tol in (("a32", 2e-6), ("a8", 5e-2)):
            mlp = cpu_blocks.BlockMLP(gu, dn, hidden, inter, numerics, act, isa)
            for m in (1, 3, 17, 64):
                x = rng.standard_normal((m, hidden)).astype(np.float32) * 4
                out = torch.empty(m, hidden)
                mlp(torch.from_numpy(x), out)
                h = torch.from_numpy(x.astype(np.float64) @ wg.T)
                ref = (fn(h[:, :inter]) * h[:, inter:]).numpy() @ wd.T
                err = np.abs(out.numpy() - ref).max() / np.abs(ref).max()
                assert err <= tol, f"{isa} {act} {numerics} M={m}: relative error {err:.2e}"


def test_segments_the_product_cannot_take_are_refused() -> None:
    k = 256
    ok = torch.zeros(4, cpu_quant.row_bytes(Q8_0, k), dtype=torch.uint8)
    assert cpu_blocks.takes([(ok, Q8_0)], k)
    assert not cpu_blocks.takes([(ok, Q8_0)] * (cpu_blocks.MAX_PARTS + 1), k)
    assert not cpu_blocks.takes([(ok, Q4_K)], k)  # rows of another type's size
    assert not cpu_blocks.takes([(ok, 99)], k)
    assert not cpu_blocks.takes([(ok[:, :-1], Q8_0)], k)
    with pytest.raises(ValueError, match="segments of width 256"):
        cpu_blocks.BlockProduct([], k, "a32")
    with pytest.raises(ValueError, match="must stack"):
        cpu_blocks.BlockMLP([(ok, Q8_0)], [(ok, Q8_0)], k, k, "a32", "silu")
    tiles = torch.zeros(cpu_quant.packed_bytes(Q8_0, 4, k), dtype=torch.uint8)
    assert cpu_blocks.takes_packed([(tiles, Q8_0, 4)], k)
    assert not cpu_blocks.takes_packed([(tiles, Q8_0, 17)], k)  # 17 rows: two tiles
    assert not cpu_blocks.takes_packed([(tiles[:-1], Q8_0, 4)], k)
    assert not cpu_blocks.takes_packed([(ok, Q8_0, 4)], k)  # raw blocks, not tiles
    assert not cpu_blocks.takes_packed([(tiles, Q8_0, 4)] * (cpu_blocks.MAX_PARTS + 1), k)
    with pytest.raises(ValueError, match="packed segments of width 256"):
        cpu_blocks.PackedPartsProduct([], k, "a32")
