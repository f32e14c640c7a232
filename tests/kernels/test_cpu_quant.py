"""kernels/cpu/quant.py against float64 products of the `gguf` package's dequantized weights.

Random blocks of every type (random bytes with finite fp16 scales, some extreme: +-65504,
subnormal, zero; some whole blocks zero), every row count 1..70, each ISA path forced.
Tolerances: a32 (float32 products of the expanded weights): |err| <= K 2^-23 (|W| @ |x|), the
float32 summation bound. a8: that plus sum over 32-groups of (dx/2) sum|w|, with dx =
max|x_group| / 127, the worst case of rounding the activations to int8.
"""

from __future__ import annotations

import c_build
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.cpu import quant as cpu_quant


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())


FP16_AT = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}
EXTREME = np.array([65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1e-4], dtype=np.float16)
ISAS = [i for i in ("scalar", "avx2", "avx512")]


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    elems, nbytes = cpu_quant.BLOCKS[type_id]
    nb = k // elems
    b = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)
    for off in FP16_AT[type_id]:
        scales = rng.uniform(-0.1, 0.1, size=(n, nb)).astype(np.float16)
        pick = rng.random((n, nb)) < 0.1
        scales[pick] = rng.choice(EXTREME, size=int(pick.sum()))
        b[..., off:off + 2] = scales.view(np.uint8).reshape(n, nb, 2)
    b[rng.random((n, nb)) < 0.05] = 0  # whole zero blocks
    return b.reshape(n, nb * nbytes)


def widths(type_id: int) -> list[int]:
    # NOTE: 96 is not a multiple of 256: allowed for the 32-weight block types only
    return [96, 512] if cpu_quant.BLOCKS[type_id][0] == 32 else [256, 512]


def a8_slack(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[M, N]: sum over groups of max|x_g| / 254 * sum_g |w|."""
    m, k = x.shape
    dx = np.abs(x.reshape(m, k // 32, 32)).max(-1) / 127.0  # [M, G]
    wabs = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, G]
    return dx @ wabs.T / 2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_id", sorted(cpu_quant.BLOCKS), ids=lambda t: cpu_quant.TYPE_NAMES[t])
def test_matmul_matches_float64_of_gguf_dequantized(type_id: int, isa: str) -> None:
    c_build.require_isa(isa, cpu_quant.isa_supported(isa))
    rng = np.random.default_rng(type_id)
    for k in widths(type_id):
        n = 37  # NOTE: not a multiple of the kernel's 16-feature chunks
        blocks = random_blocks(type_id, n, k, rng)
        w = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float64)
        assert np.isfinite(w).all()
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3] = 0.0  # a zero row: dx = 0
        x[5, :32] *= 1e4  # one large group
        ref_all = x.astype(np.float64) @ w.T
        bound_all = k * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        slack_all = a8_slack(x.astype(np.float64), w)
        bt = torch.from_numpy(blocks)
        for m in range(1, 71):
            xm = torch.from_numpy(x[:m])
            for numerics in ("a32", "a8"):
                got = cpu_quant.matmul(xm, bt, type_id, k, numerics, isa).double().numpy()
                bound = bound_all[:m] + (slack_all[:m] * 1.001 if numerics == "a8" else 0)
                err = np.abs(got - ref_all[:m])
                worst = np.unravel_index(np.argmax(err - bound), err.shape)
                assert (err <= bound).all(), (
                    f"{cpu_quant.TYPE_NAMES[type_id]} {isa} {numerics} K={k} M={m}: "
                    f"err {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}")


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_rows_gathers_gguf_rows(isa: str) -> None:
    c_build.require_isa(isa, cpu_quant.isa_supported(isa))
    rng = np.random.default_rng(1)
    for type_id in sorted(cpu_quant.BLOCKS):
        k = widths(type_id)[0]
        blocks = random_blocks(type_id, 20, k, rng)
        w = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float32)
        ids = torch.tensor([7, 0, 19, 7])
        got = cpu_quant.dequantize_rows(torch.from_numpy(blocks), type_id, k, ids=ids, isa=isa)
        # NOTE: the SIMD paths expand a q + b with one FMA, gguf with two roundings
        np.testing.assert_allclose(got.numpy(), w[ids.numpy()], rtol=2**-22, atol=1e-37)
        tile = cpu_quant.dequantize_rows(torch.from_numpy(blocks), type_id, k, first=3,
                                         count=5, isa=isa)
        np.testing.assert_allclose(tile.numpy(), w[3:8], rtol=2**-22, atol=1e-37)


def test_bad_shapes_and_ids_are_refused() -> None:
    blocks = torch.zeros(4, 18, dtype=torch.uint8)  # Q4_0, K = 32
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_quant.matmul(torch.zeros(1, 48), blocks, 2, 48)
    with pytest.raises(ValueError, match="bytes"):
        cpu_quant.matmul(torch.zeros(1, 64), blocks, 2, 64)
    with pytest.raises(IndexError):
        cpu_quant.dequantize_rows(blocks, 2, 32, ids=torch.tensor([4]))
    assert cpu_quant.best_isa() in cpu_quant.ISAS


@pytest.fixture
def _packed() -> None:
    """The packed kernels need AVX-512 VNNI (after the autouse build check)."""
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))


packed_only = pytest.mark.usefixtures("_packed")


@packed_only
@pytest.mark.parametrize("type_id", cpu_quant.PACKED_TYPES, ids=lambda t: cpu_quant.TYPE_NAMES[t])
def test_packed_matmul_matches_float64_of_gguf_dequantized(type_id: int) -> None:
    """The 16-feature tiles of `pack`: same bounds as the raw kernels, N not a multiple of 16."""
    rng = np.random.default_rng(100 + type_id)
    for k in widths(type_id):
        n = 37
        blocks = random_blocks(type_id, n, k, rng)
        w = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float64)
        packed = cpu_quant.pack(torch.from_numpy(blocks), type_id, k)
        assert packed.numel() == 48 * k // 32 * (blocks.shape[1] // (k // 32))  # same bytes
        x = rng.standard_normal((70, k)).astype(np.float32)
        x[3] = 0.0
        x[5, :32] *= 1e4
        ref_all = x.astype(np.float64) @ w.T
        bound_all = k * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        slack_all = a8_slack(x.astype(np.float64), w)
        for m in range(1, 71):
            xm = torch.from_numpy(x[:m])
            for numerics in ("a32", "a8"):
                got = cpu_quant.packed_matmul(xm, packed, type_id, n, k, numerics).double().numpy()
                bound = bound_all[:m] + (slack_all[:m] * 1.001 if numerics == "a8" else 0)
                err = np.abs(got - ref_all[:m])
                worst = np.unravel_index(np.argmax(err - bound), err.shape)
                assert (err <= bound).all(), (
                    f"{cpu_quant.TYPE_NAMES[type_id]} packed {numerics} K={k} M={m}: "
                    f"err {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}")


@packed_only
@pytest.mark.parametrize("type_id", cpu_quant.PACKED_TYPES, ids=lambda t: cpu_quant.TYPE_NAMES[t])
def test_packed_rows_and_kmajor_tiles_are_gguf_weights(type_id: int) -> None:
    rng = np.random.default_rng(200 + type_id)
    k, n = 96, 37
    blocks = random_blocks(type_id, n, k, rng)
    w = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float32)
    packed = cpu_quant.pack(torch.from_numpy(blocks), type_id, k)
    ids = torch.tensor([36, 0, 17, 36])
    # NOTE: d u + m in one FMA; gguf rounds d q and then adds m (Q4_1)
    np.testing.assert_allclose(cpu_quant.packed_rows(packed, type_id, n, k, ids=ids).numpy(),
                               w[ids.numpy()], rtol=2**-22, atol=1e-37)
    np.testing.assert_allclose(cpu_quant.packed_rows(packed, type_id, n, k, first=30, count=7),
                               w[30:], rtol=2**-22, atol=1e-37)
    tiles = cpu_quant.packed_kmajor(packed, type_id, n, k, 1, 3).numpy()  # features 16..47
    np.testing.assert_allclose(tiles[:, :21], w[16:].T, rtol=2**-22, atol=1e-37)
    assert (tiles[:, 21:] == 0).all()  # past N: zeros
    with pytest.raises(IndexError):
        cpu_quant.packed_rows(packed, type_id, n, k, ids=torch.tensor([37]))


@packed_only
@pytest.mark.parametrize("type_id", cpu_quant.PACKED_TYPES, ids=lambda t: cpu_quant.TYPE_NAMES[t])
def test_packed_mlp_matches_float64(type_id: int) -> None:
    """down(act(gate) * up) in one call against float64 products of the gguf weights and
    torch's float64 activations. a32: float32 rounding (relative 2e-6 of the output's max);
    a8: int8 activations twice (relative 5e-2, measured about 1e-2)."""
    rng = np.random.default_rng(300 + type_id)
    hidden, inter = 96, 160  # NOTE: 2 * inter = 320 features, hidden 96: partial tiles
    gu, dn = random_blocks(type_id, 2 * inter, hidden, rng), random_blocks(type_id, hidden,
                                                                           inter, rng)
    for b, k in ((gu, hidden), (dn, inter)):  # NOTE: moderate scales: SiLU's whole range
        v = b.reshape(b.shape[0], k // 32, -1)
        v[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        if type_id == 3:
            v[..., 2:4] = np.array([-0.05], dtype=np.float16).view(np.uint8)
    wg = dequantize(gu, GGMLQuantizationType(type_id)).astype(np.float64)
    wd = dequantize(dn, GGMLQuantizationType(type_id)).astype(np.float64)
    pg = cpu_quant.pack(torch.from_numpy(gu), type_id, hidden)
    pd = cpu_quant.pack(torch.from_numpy(dn), type_id, inter)
    acts = {"silu": torch.nn.functional.silu,
            "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}
    for act, fn in acts.items():
        for numerics, tol in (("a32", 2e-6), ("a8", 5e-2)):
            mlp = cpu_quant.PackedMLP(pg, type_id, pd, type_id, hidden, inter, numerics, act)
            for m in (1, 3, 17, 64):
                x = rng.standard_normal((m, hidden)).astype(np.float32)
                out = torch.empty(m, hidden)
                mlp(torch.from_numpy(x), out)
                h = torch.from_numpy(x.astype(np.float64) @ wg.T)
                ref = ((fn(h[:, :inter]) * h[:, inter:]).numpy() @ wd.T)
                err = np.abs(out.numpy() - ref).max() / np.abs(ref).max()
                assert err <= tol, f"{act} {numerics} M={m}: relative error {err:.2e}"
