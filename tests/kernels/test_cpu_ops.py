"""kernels/cpu/ops.py's fused RMSNorm and rope against the model's torch formulas, and the
model with them on against the model with them off."""

from __future__ import annotations

import c_build
import pytest
import torch

from engine.models.accelerate import set_fused_cpu_ops
from engine.models.config import ModelConfig
from engine.models.forward_context import ForwardContext, forward_context
from engine.models.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding
from kernels.attention import torch_backend
from kernels.attention.metadata import AttentionMetadata
from kernels.cpu import ops as cpu_ops


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_ops.available() else cpu_ops.build_error())


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("rows", [1, 7, 200])  # 200: the OpenMP-parallel branch
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_formula(rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    x = torch.randn(rows, 64, generator=gen) * 3
    residual = torch.randn(rows, 64, generator=gen) if with_residual else None
    want = norm(x) if residual is None else norm(x, residual.clone())
    norm.fused = True
    got = norm(x) if residual is None else norm(x, residual)
    if residual is None:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    assert torch.equal(got[1], want[1])  # the residual sum is one IEEE add either way
    assert got[1] is residual  # written in place


@pytest.mark.parametrize("tokens", [1, 9, 130])
def test_rms_norm_heads_matches_float64_in_place(tokens):
    """Qwen3's and Gemma 3's per-head q/k norms: each head of strided rows (q and k of a fused
    qkv row) normed in place; v and the other heads untouched."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 8, 16, generator=gen) * 3  # 4 q, 2 k, 2 v heads
    weight = torch.randn(16, generator=gen)
    before = qkv.clone()
    cpu_ops.rms_norm_heads(qkv[:, 4:6], weight, 1e-6)  # the k heads
    x = before[:, 4:6].double()
    want = weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(qkv[:, 4:6].double(), want, rtol=2e-6, atol=2e-6)
    assert torch.equal(qkv[:, :4], before[:, :4]) and torch.equal(qkv[:, 6:], before[:, 6:])


@pytest.mark.parametrize("tokens", [1, 9, 130])
def test_rope_is_bit_identical_to_the_torch_formula(tokens):
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(_cfg(), 256, torch.device("cpu"))
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    qkv = torch.randn(tokens, 8, 16, generator=gen) * 5  # q, k, v heads of one fused row
    x = qkv[:, :6]  # strided rows, as the model passes q and k
    want = rope.lookup(positions, torch.float32)(x)
    tables = rope.lookup(positions, torch.float32, fused=True)
    assert tables.fused and tables.cos is None
    assert torch.equal(tables(x), want)


def test_rope_falls_back_where_the_kernel_does_not_fit():
    rope = RotaryEmbedding(_cfg(), 64, torch.device("cpu"))
    positions = torch.arange(5)
    x = torch.randn(3, 5, 16).transpose(0, 1)  # heads not back to back within a row
    assert not cpu_ops.rope_input_fits(x)
    torch.testing.assert_close(rope.lookup(positions, torch.float32, fused=True)(x),
                               rope.lookup(positions, torch.float32)(x))


def test_model_with_fused_ops_matches_the_torch_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_cfg())
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.init_rope(256, torch.device("cpu"))
    ids, positions = torch.randint(0, 97, (11,)), torch.arange(11)
    caches = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)) for _ in range(3)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 11], dtype=torch.int32),
        seq_lens=torch.tensor([11], dtype=torch.int32),
        block_tables=torch.tensor([[1]]), slot_mapping=torch.arange(16, 27),
        num_decodes=0, query_lens_cpu=[11], seq_lens_cpu=[11], max_decode_seq_len=0)
    outs = []
    for on in (False, True):
        set_fused_cpu_ops(model, on)
        assert model.fused_cpu_ops == on
        with forward_context(ForwardContext(meta, caches, torch_backend)):
            outs.append(model(ids, positions))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 15, 64, 100, 49152])
def test_argmax_matches_torch(n):
    """The first largest value, the first NaN where there is one, -inf rows, strided rows."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(6, n + 3, generator=gen)[:, :n]  # rows 3 floats apart beyond n
    x[1] = x[1].round()  # ties: the first of them
    x[2, n // 2] = float("nan")
    x[2, -1] = float("nan")
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    x[5] = torch.full((n,), 7.0)
    assert x.stride(0) == n + 3
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax(x[:0]), x[:0].argmax(dim=-1))
