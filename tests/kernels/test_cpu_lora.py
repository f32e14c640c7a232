"""kernels/cpu/lora.py (csrc/lora.c) against float64 torch: the per-row LoRA delta for rows of
several adapter slots interleaved with rows of none, at odd sizes and strides, on every ISA
path the CPU has; and the one-call MLPs (quant_packed.c's and quant_kpacked.c's) adding the
deltas of gate_up before the activation and of down after it."""

from __future__ import annotations

import c_build
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.cpu import lora as cpu_lora
from kernels.cpu import quant as cpu_quant
from kernels.cpu.lora import SlotWeights


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_lora.available() else cpu_lora.build_error())


def _reference(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
               w: SlotWeights) -> torch.Tensor:
    """out + B(A x) per row in float64, row by row (slot -1: unchanged)."""
    ref = out.double().clone()
    for r, s in enumerate(slots.tolist()):
        if s >= 0:
            ref[r] += (w.a[s].double() @ x[r].double()) @ w.bt[s].double()
    return ref


def _slots(rows: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Interleaved slots with no-adapter rows (-1) among them, every slot used."""
    s = torch.randint(-1, num_slots, (rows,), generator=gen, dtype=torch.int32)
    s[: num_slots + 1] = torch.arange(-1, num_slots, dtype=torch.int32)
    return s[torch.randperm(rows, generator=gen)].contiguous()


# (rows, slots, rank, in, out): a few rows; odd sizes; groups past one 16-row block and
# rows past a pass of four; enough work for the threads' region
CASES = [(9, 3, 13, 37, 71), (5, 1, 48, 64, 128), (45, 4, 16, 100, 150), (70, 2, 32, 96, 200)]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_delta_matches_float64(isa: str, case: tuple[int, ...]) -> None:
    """x, out and bt as strided views (rows further apart than their widths); error under
    1e-5 of the delta's largest value (float32 sums of up to 100 terms); rows without an
    adapter untouched."""
    c_build.require_isa(isa, cpu_quant.isa_supported(isa))
    rows, num_slots, rank, k, n = case
    gen = torch.Generator().manual_seed(sum(case))
    a = torch.randn(num_slots, rank, k, generator=gen)
    bt = torch.randn(num_slots, rank, n + 5, generator=gen)[..., 2 : 2 + n]
    w = SlotWeights(a, bt)
    assert w.runs_in_c() and bt.stride(1) == n + 5
    x = torch.randn(rows, k + 3, generator=gen)[:, 1 : 1 + k]
    slots = _slots(rows, num_slots, gen)
    for threads in (1, 2):
        out = torch.randn(rows, n + 7, generator=gen)[:, 3 : 3 + n]
        before = out.clone()
        assert cpu_lora.fits(out, x, w)
        ref = _reference(out, x, slots, w)
        cpu_lora.add_delta(out, x, slots, w, isa=isa, num_threads=threads)
        err = (out.double() - ref).abs().max() / (ref - before.double()).abs().max()
        assert err < 1e-5, f"{isa} threads {threads}: relative error {err:.2e}"
        assert torch.equal(out[slots < 0], before[slots < 0])


def test_slots_out_of_range_and_bad_row_slots_are_refused() -> None:
    w = SlotWeights(torch.zeros(2, 4, 8), torch.zeros(2, 4, 16))
    x, out = torch.zeros(3, 8), torch.zeros(3, 16)
    with pytest.raises(IndexError, match="out of range"):
        cpu_lora.add_delta(out, x, torch.tensor([0, 2, -1], dtype=torch.int32), w)
    with pytest.raises(ValueError, match="int32"):
        cpu_lora.add_delta(out, x, torch.tensor([0, 1, -1]), w)
    assert not cpu_lora.fits(out.double(), x.double(), w)
    assert not cpu_lora.fits(torch.zeros(3, 15), x, w)


def _quantized(rows: int, cols: int, type_id: int, rng: np.random.Generator):
    """Blocks of random weights and their float64 dequantization (the `gguf` package's)."""
    kind = GGMLQuantizationType(type_id)
    blocks = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind)
    return blocks, dequantize(blocks, kind).astype(np.float64)


@pytest.mark.parametrize("type_id", [3, 6], ids=["Q4_1", "Q5_0"])  # mlp.c, quant_kpacked.c
def test_the_one_call_mlp_adds_gate_up_deltas_before_the_activation(type_id: int) -> None:
    """out = down(act(gate) * up) with gate|up += their delta before the activation and
    the down product's delta after, per row (some rows with no adapter), against float64;
    a32: relative 1e-5 of the output's max."""
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))
    rng = np.random.default_rng(31 + type_id)
    gen = torch.Generator().manual_seed(type_id)
    hidden, inter, num_slots, rank = 256, 256, 3, 8
    (gu, wg), (dn, wd) = _quantized(2 * inter, hidden, type_id, rng), _quantized(
        hidden, inter, type_id, rng)
    pg = cpu_quant.pack(torch.from_numpy(gu), type_id, hidden)
    pd = cpu_quant.pack(torch.from_numpy(dn), type_id, inter)
    mlp = cpu_quant.PackedMLP(pg, type_id, pd, type_id, hidden, inter, "a32", "silu")
    w_gu = SlotWeights(torch.randn(num_slots, 2 * rank, hidden, generator=gen) * 0.1,
                       torch.randn(num_slots, 2 * rank, 2 * inter, generator=gen) * 0.1)
    w_dn = SlotWeights(torch.randn(num_slots, rank, inter, generator=gen) * 0.1,
                       torch.randn(num_slots, rank, hidden, generator=gen) * 0.1)
    deltas = cpu_lora.MlpDeltas(w_gu, w_dn)
    for m in (1, 6, 19):
        x = torch.randn(m, hidden, generator=gen)
        slots = _slots(m, num_slots, gen) if m > num_slots else torch.tensor(
            [1] * m, dtype=torch.int32)
        out = torch.empty(m, hidden)
        mlp(x, out, deltas.address(slots))
        h = _reference(x.double() @ torch.from_numpy(wg).T, x, slots, w_gu)
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        ref = _reference(a @ torch.from_numpy(wd).T, a, slots, w_dn)
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, f"M={m}: relative error {err:.2e}"
        plain = torch.empty(m, hidden)
        mlp(x, plain)  # NOTE: no LoRA: the base alone, far from the adapted rows
        adapted = slots >= 0
        assert (plain - out)[adapted].abs().max() > 1e-2 * ref.abs().max()
        assert torch.equal(plain[~adapted], out[~adapted])
