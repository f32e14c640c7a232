"""Prepacked linear layers (oneDNN, MKL) against the float64 product and the torch reference
model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.models import cpu_linear
from engine.models.cpu_linear import (
    DENSE_MAX_ROWS,
    SMALL_MAX_ROWS,
    PackedLinear,
    mkl_packed_available,
    pack_linears,
    resolve_mode,
)
from ipc.config import EngineConfig

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="torch without oneDNN")


SMALLS = [None, "dense", pytest.param("mkl", marks=pytest.mark.skipif(
    not mkl_packed_available(), reason="torch without MKL's packed GEMM"))]


@pytest.mark.parametrize("small", SMALLS, ids=["onednn", "dense", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 2, DENSE_MAX_ROWS, DENSE_MAX_ROWS + 1, 17,
                                  SMALL_MAX_ROWS, SMALL_MAX_ROWS + 1, 300])
def test_packed_linear_matches_the_float64_product(rows, bias, small):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 96, generator=gen)
    layer = PackedLinear(w, b, small)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = layer(x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("small", SMALLS, ids=["onednn", "dense", "mkl"])
def test_strided_and_3d_inputs(small):
    w = torch.randn(64, 32)
    layer = PackedLinear(w, None, small)
    x = torch.randn(6, 64)[:, ::2]  # not contiguous
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 32)
    torch.testing.assert_close(layer(x3), F.linear(x3, w), rtol=1e-5, atol=1e-5)


def _count_calls(monkeypatch, namespace, name: str) -> list[int]:
    calls = []
    real = getattr(namespace, name)
    monkeypatch.setattr(namespace, name, lambda *a: calls.append(a[0].shape[0]) or real(*a),
                        raising=False)
    return calls


def test_dense_small_takes_the_dense_product_for_few_rows(monkeypatch):
    layer = PackedLinear(torch.randn(8, 4), None, small="dense")
    calls = _count_calls(monkeypatch, cpu_linear.torch.ops.mkldnn, "_linear_pointwise")
    for rows in range(1, DENSE_MAX_ROWS + 3):
        layer(torch.randn(rows, 4))
    assert calls == [DENSE_MAX_ROWS + 1, DENSE_MAX_ROWS + 2]


@pytest.mark.skipif(not mkl_packed_available(), reason="torch without MKL's packed GEMM")
def test_mkl_small_takes_the_mkl_product_up_to_its_rows(monkeypatch):
    layer = PackedLinear(torch.randn(8, 4), None, small="mkl")
    mkl = _count_calls(monkeypatch, cpu_linear.torch.ops.mkl, "_mkl_linear")
    onednn = _count_calls(monkeypatch, cpu_linear.torch.ops.mkldnn, "_linear_pointwise")
    for rows in (1, 2, 4, SMALL_MAX_ROWS, SMALL_MAX_ROWS + 1):
        layer(torch.randn(rows, 4))
    assert mkl == [1, 2, 4, SMALL_MAX_ROWS] and onednn == [SMALL_MAX_ROWS + 1]


class _Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16, bias=False))
        self.lm_head = None if tied else nn.Linear(16, 50, bias=False)


@pytest.mark.parametrize("mode", ["onednn", "dual"])
@pytest.mark.parametrize("tied", [True, False])
def test_pack_linears_replaces_every_plain_linear(mode, tied):
    model = _Tiny(tied)
    ref = [model.block[0].weight.clone(), model.block[2].weight.clone()]
    pack_linears(model, mode)
    layers = [model.block[0], model.block[2], model.lm_head]
    assert all(isinstance(m, PackedLinear) for m in layers)
    dual_small = "mkl" if mkl_packed_available() else "dense"
    assert model.block[0].small == (dual_small if mode == "dual" else None)
    if tied:  # the head's dense copy, where it has one, is the embedding itself (no cost)
        assert model.lm_head.small == (dual_small if mode == "dual" else "dense")
        dense = model.lm_head.dense
        assert dense is None or dense.data_ptr() == model.embed_tokens.weight.data_ptr()
    x = torch.randn(5, 16)
    torch.testing.assert_close(model.block[2](model.block[1](model.block[0](x))),
                               F.linear(F.silu(F.linear(x, ref[0], model.block[0].bias)), ref[1]),
                               rtol=1e-5, atol=1e-5)


def test_auto_mode_and_refusals(monkeypatch):
    model, cpu = _Tiny(tied=True), torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "_available_bytes", lambda: 1 << 40)
    assert resolve_mode("auto", model, cpu, torch.float32) == "dual"
    assert resolve_mode("auto", model, cpu, torch.bfloat16) == "torch"
    assert resolve_mode("auto", model, torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setattr(cpu_linear, "_available_bytes", lambda: 1000)  # the copy does not fit
    assert resolve_mode("auto", model, cpu, torch.float32) == "torch"
    assert resolve_mode("onednn", model, cpu, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="float32"):
        resolve_mode("dual", model, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_linear"):
        EngineConfig(cpu_linear="mkl")
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(cpu_linear="dual", tensor_parallel_size=2)
    assert EngineConfig(tensor_parallel_size=2).cpu_linear == "auto"


def test_engine_greedy_output_is_the_same_in_every_mode(tiny_model_dir):
    """Eight prompts at once: decode steps take the packed product (more than 3 rows)."""
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for mode in ("torch", "onednn", "dual"):
        llm = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=64, cpu_linear=mode)
        assert llm.engine.cpu_linear == mode
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["onednn"] == outs["torch"] == outs["dual"]
