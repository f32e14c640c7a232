"""kernels/cpu/csrc/quant_kpacked.c's packed tiles (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), reached through
kernels/cpu_quant.py's packed entry points, against float64 products of the `gguf` package's
dequantized weights. Random blocks as in test_cpu_quant.py (extreme and zero fp16 scales,
whole zero blocks); the same bounds: a32 |err| <= K 2^-23 (|W| @ |x|); a8 that plus the worst
case of rounding the activations to int8 per 32 values.
"""

from __future__ import annotations

import c_build
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.cpu import kquant as cpu_kquant
from kernels.cpu import quant as cpu_quant

TYPES = cpu_kquant.TYPES
FP16_AT = {6: [0], 7: [0, 2], 12: [0, 2], 13: [0, 2], 14: [208]}
EXTREME = np.array([65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1e-4], dtype=np.float16)


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))
    c_build.require(None if cpu_kquant.available() else cpu_kquant.build_error())


def name(type_id: int) -> str:
    return cpu_quant.TYPE_NAMES[type_id]


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator,
                  scale: float = 0.1) -> np.ndarray:
    elems, nbytes = cpu_quant.BLOCKS[type_id]
    nb = k // elems
    b = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)
    for off in FP16_AT[type_id]:
        scales = rng.uniform(-scale, scale, size=(n, nb)).astype(np.float16)
        if scale == 0.1:
            pick = rng.random((n, nb)) < 0.1
            scales[pick] = rng.choice(EXTREME, size=int(pick.sum()))
        b[..., off:off + 2] = scales.view(np.uint8).reshape(n, nb, 2)
    if scale == 0.1:
        b[rng.random((n, nb)) < 0.05] = 0  # whole zero blocks
    return b.reshape(n, nb * nbytes)


def widths(type_id: int) -> list[int]:
    return [96, 512] if cpu_quant.BLOCKS[type_id][0] == 32 else [256, 768]


def gguf_f64(blocks: np.ndarray, type_id: int) -> np.ndarray:
    return dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float64)


def a8_slack(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    m, k = x.shape
    dx = np.abs(x.reshape(m, k // 32, 32)).max(-1) / 127.0
    wabs = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(-1)
    return dx @ wabs.T / 2


@pytest.mark.parametrize("type_id", TYPES, ids=name)
def test_packed_matmul_matches_float64_of_gguf_dequantized(type_id: int) -> None:
    rng = np.random.default_rng(500 + type_id)
    assert cpu_quant.packs(type_id, widths(type_id)[0])
    for k in widths(type_id):
        n = 37  # NOTE: not a multiple of 16: a partial last tile
        blocks = random_blocks(type_id, n, k, rng)
        w = gguf_f64(blocks, type_id)
        assert np.isfinite(w).all()
        packed = cpu_quant.pack(torch.from_numpy(blocks), type_id, k)
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3] = 0.0
        x[5, :32] *= 1e4
        ref_all = x.astype(np.float64) @ w.T
        bound_all = k * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        slack_all = a8_slack(x.astype(np.float64), w)
        for m in (*range(1, 18), 31, 64, 70):
            xm = torch.from_numpy(x[:m])
            for numerics in ("a32", "a8"):
                got = cpu_quant.packed_matmul(xm, packed, type_id, n, k, numerics)
                product = cpu_quant.PackedProduct(packed, type_id, n, k, numerics)
                again = torch.empty(m, n)
                product(xm, again)
                assert torch.equal(got, again)  # the per-token call: the same kernel
                bound = bound_all[:m] + (slack_all[:m] * 1.001 if numerics == "a8" else 0)
                err = np.abs(got.double().numpy() - ref_all[:m])
                worst = np.unravel_index(np.argmax(err - bound), err.shape)
                assert (err <= bound).all(), (
                    f"{name(type_id)} packed {numerics} K={k} M={m}: "
                    f"err {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}")


@pytest.mark.parametrize("type_id", TYPES, ids=name)
def test_packed_tiles_keep_the_raw_size_but_for_k4_k5_scales(type_id: int) -> None:
    k = widths(type_id)[0]
    raw = 32 * cpu_quant.row_bytes(type_id, k)
    packed = cpu_quant.pack(torch.zeros(32, cpu_quant.row_bytes(type_id, k),
                                        dtype=torch.uint8), type_id, k)
    extra = 2 * 64 * (k // 256) if type_id in (12, 13) else 0  # unpacked 6-bit scales
    assert packed.numel() == raw + extra


@pytest.mark.parametrize("type_id", TYPES, ids=name)
def test_packed_rows_and_kmajor_tiles_are_gguf_weights(type_id: int) -> None:
    rng = np.random.default_rng(600 + type_id)
    k, n = widths(type_id)[0], 37
    blocks = random_blocks(type_id, n, k, rng)
    w = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float32)
    packed = cpu_quant.pack(torch.from_numpy(blocks), type_id, k)
    ids = torch.tensor([36, 0, 17, 36])
    np.testing.assert_allclose(cpu_quant.packed_rows(packed, type_id, n, k, ids=ids).numpy(),
                               w[ids.numpy()], rtol=2**-22, atol=1e-37)
    np.testing.assert_allclose(cpu_quant.packed_rows(packed, type_id, n, k, first=30, count=7),
                               w[30:], rtol=2**-22, atol=1e-37)
    tiles = cpu_quant.packed_kmajor(packed, type_id, n, k, 1, 3).numpy()  # features 16..47
    np.testing.assert_allclose(tiles[:, :21], w[16:].T, rtol=2**-22, atol=1e-37)
    assert (tiles[:, 21:] == 0).all()  # past N: zeros
    with pytest.raises(IndexError):
        cpu_quant.packed_rows(packed, type_id, n, k, ids=torch.tensor([37]))


# NOTE: the pairs Q4_K_M files hold (gate/up Q5_0 where the width is not a multiple of 256,
# down Q4_K or Q6_K), and each type alone
MLP_PAIRS = [(6, 14), (6, 12), (12, 14), *((t, t) for t in TYPES)]


@pytest.mark.parametrize("pair", MLP_PAIRS, ids=lambda p: f"{name(p[0])}-{name(p[1])}")
def test_packed_mlp_matches_float64(pair: tuple[int, int]) -> None:
    """down(act(gate) * up) in one call against float64 products of the gguf weights and
    torch's float64 activations: a32 relative 2e-6 of the output's max, a8 5e-2."""
    tgu, td = pair
    rng = np.random.default_rng(700 + 17 * tgu + td)
    hidden, inter = 256, 512 + (0 if td in (12, 13, 14) else 32)
    # NOTE: moderate scales (no extremes): SiLU's whole range, no overflow
    gu = random_blocks(tgu, 2 * inter, hidden, rng, scale=0.01)
    dn = random_blocks(td, hidden, inter, rng, scale=0.01)
    wg, wd = gguf_f64(gu, tgu), gguf_f64(dn, td)
    pg = cpu_quant.pack(torch.from_numpy(gu), tgu, hidden)
    pd = cpu_quant.pack(torch.from_numpy(dn), td, inter)
    assert cpu_quant.fuses(tgu, td)
    acts = {"silu": torch.nn.functional.silu,
            "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}
    for act, fn in acts.items():
        for numerics, tol in (("a32", 2e-6), ("a8", 5e-2)):
            mlp = cpu_quant.PackedMLP(pg, tgu, pd, td, hidden, inter, numerics, act)
            for m in (1, 3, 17, 64):
                x = rng.standard_normal((m, hidden)).astype(np.float32)
                out = torch.empty(m, hidden)
                mlp(torch.from_numpy(x), out)
                h = torch.from_numpy(x.astype(np.float64) @ wg.T)
                ref = (fn(h[:, :inter]) * h[:, inter:]).numpy() @ wd.T
                err = np.abs(out.numpy() - ref).max() / np.abs(ref).max()
                assert err <= tol, f"{act} {numerics} M={m}: relative error {err:.2e}"


def test_an_mlp_across_the_two_libraries_is_refused() -> None:
    assert not cpu_quant.fuses(3, 14) and not cpu_quant.fuses(14, 8) and cpu_quant.fuses(2, 8)
    gu = cpu_quant.pack(torch.zeros(512, cpu_quant.row_bytes(3, 256), dtype=torch.uint8), 3,
                        256)
    dn = cpu_quant.pack(torch.zeros(256, cpu_quant.row_bytes(14, 256), dtype=torch.uint8), 14,
                        256)
    with pytest.raises(ValueError, match="Q4_1 gate/up with Q6_K down"):
        cpu_quant.PackedMLP(gu, 3, dn, 14, 256, 256, "a8", "silu")


def test_widths_the_blocks_cannot_hold_are_not_packed() -> None:
    assert not cpu_quant.packs(12, 640) and cpu_quant.packs(6, 640)
    with pytest.raises(ValueError, match="cannot pack Q4_K"):
        cpu_quant.pack(torch.zeros(16, 144 * 3, dtype=torch.uint8), 12, 640)
