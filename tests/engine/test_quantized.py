"""Quantized weights in the engine (--quantization): tiny GGUF files of each block type.

`gguf` (a32 numerics) must give the greedy tokens of `none` (the same file dequantized to
float32) token for token: a32 is the dequantized product up to summation order. `a8` is
reported (agreement, log-prob error) and checked only for being close. `int8` on a dense
checkpoint: sampled-token log-probs within a stated tolerance of the dense run.
"""

from __future__ import annotations

import c_build
import pytest
import torch
from agreement import greedy_agreement
from tiny_quant_gguf import write_tiny_gguf

from engine import LLM, SamplingParams
from engine.models.loader import float32_cache
from engine.models.quant_linear import QuantEmbedding, QuantLinear
from ipc.model_source import resolve_model
from kernels.cpu import kquant
from kernels.cpu import quant as cpu_quant


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())


PROMPTS = [[1, 422, 3110, 2706], [1] + list(range(300, 340)), [5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
SMALL = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
# NOTE: llama-quantize's Q4_K_M mix on a file of 256-wide rows: v and down Q6_K, the rest
# Q4_K, so the fused qkv holds two segments of two types
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}


def _run(path, tok_dir, **options):
    options.setdefault("quantization_numerics", "a32")  # NOTE: the exact mode unless asked
    llm = LLM(str(path), tokenizer=str(tok_dir), max_model_len=256, num_gpu_blocks=64,
              **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return llm, outs


@pytest.mark.parametrize("type_name", [*SMALL, *K_TYPES, "Q4_K_M"])
def test_gguf_a32_equals_dequantized(type_name, tiny_model_dir, wide_model_dir,
                                     bundled_tokenizer_dir, tmp_path):
    mix = Q4_K_M if type_name == "Q4_K_M" else None
    if mix:
        type_name = "Q4_K"
    src = wide_model_dir if type_name in K_TYPES else tiny_model_dir
    path = write_tiny_gguf(src, tmp_path / f"tiny-{type_name}{'-M' * bool(mix)}.gguf",
                           type_name, overrides=mix)
    llm, quant = _run(path, bundled_tokenizer_dir, quantization="gguf")
    model = llm.engine.runner.model
    kinds = {m.parts[0].type_id for m in model.modules() if isinstance(m, QuantLinear)}
    assert cpu_quant.TYPE_NAMES[max(kinds)] in (("Q6_K",) if mix else (type_name, "Q8_0"))
    if mix:  # q|k Q4_K, v Q6_K
        assert [p.type_id for p in model.layers[0].self_attn.qkv_proj.parts] == [12, 14]
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert not any(p.dim() == 2 for p in model.parameters())  # no float32 expansion
    if type_name in ("Q4_0", "Q4_1", "Q8_0") and cpu_quant.isa_supported("avx512"):
        # NOTE: the path under test: 16-feature tiles, each MLP one kernel call
        assert all(p.packed for m in model.modules() if isinstance(m, QuantLinear)
                   for p in m.parts)
        assert model.embed_tokens.weight_q.packed
    type_id = next(k for k, v in cpu_quant.TYPE_NAMES.items() if v == type_name)
    if not (type_id in kquant.TYPES and kquant.packs(type_id, 256)):
        # NOTE: packed tiles or raw-block segments (AVX2-only CPUs: every type): each MLP one
        # kernel call, the decode steps one C call each (engine/models/fused_stack.py); the
        # stack does not take quant_kpacked.c's tiles (issue 31's hook)
        assert all(layer.mlp.fused is not None for layer in model.layers)
        assert model.decode_stack is not None and model.decode_stack.calls >= 11
    float_cache = float32_cache(resolve_model(str(path)))
    assert not float_cache.exists()
    del llm
    _, dense = _run(path, bundled_tokenizer_dir, quantization="none")
    for q, d in zip(quant, dense, strict=True):
        assert q.token_ids == d.token_ids, type_name


@pytest.mark.parametrize("other", ["F16", "Q2_K"])
def test_mixed_types_in_one_fused_layer(other, wide_model_dir, bundled_tokenizer_dir, tmp_path,
                                        caplog):
    """q/k in Q4_K, v in a type without a kernel (dequantized at load, one log line): the
    fused qkv layer has a dense segment beside its block segments."""
    path = write_tiny_gguf(wide_model_dir, tmp_path / f"mixed-{other}.gguf", "Q4_K",
                           overrides={"attn_v": other, "ffn_down": "Q6_K"})
    with caplog.at_level("INFO", logger="engine.models.loader"):
        llm, quant = _run(path, bundled_tokenizer_dir, quantization="gguf")
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert [p.type_id for p in qkv.parts] == [12, None]  # q and k merged: one kernel call
    logged = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert len(logged) == (2 if other == "Q2_K" else 0)  # F16 is a plain type: no line
    del llm
    _, dense = _run(path, bundled_tokenizer_dir, quantization="none")
    assert [o.token_ids for o in quant] == [o.token_ids for o in dense]


def test_gguf_a8_is_close(tiny_model_dir, bundled_tokenizer_dir, tmp_path, capsys):
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny-q4_1.gguf", "Q4_1")
    _, a8 = _run(path, bundled_tokenizer_dir, quantization="gguf", quantization_numerics="a8")
    _, a32 = _run(path, bundled_tokenizer_dir, quantization="gguf")
    # NOTE: logprobs=0: each position's dict holds the sampled token only
    same, total, worst = greedy_agreement(a8, a32)
    with capsys.disabled():
        print(f"\na8 vs a32 (tiny Q4_1): {same}/{total} tokens agree before the first "
              f"difference; max sampled-token log-prob error {worst:.2e}")
    assert same >= total // 2 and worst < 0.1


def test_int8_dense_checkpoint(tiny_model_dir, bundled_tokenizer_dir):
    llm, q = _run(tiny_model_dir, bundled_tokenizer_dir, quantization="int8")
    assert llm.engine.quantization == "int8"
    assert isinstance(llm.engine.runner.model.embed_tokens, QuantEmbedding)
    if cpu_quant.isa_supported("avx512"):  # Q8_0 tiles: the decode steps run as one call
        assert llm.engine.runner.model.decode_stack.calls > 0
    del llm
    _, d = _run(tiny_model_dir, bundled_tokenizer_dir, quantization="none")
    for x, y in zip(q, d, strict=True):
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if s != t:
                break
            # NOTE: Q8_0 weights (error <= d/2 = max|w| / 254 per 32) on a 2-layer model
            assert abs(x.logprobs[i][s] - y.logprobs[i][t]) < 0.05


def test_quantization_choices_are_checked(tiny_model_dir, bundled_tokenizer_dir):
    from ipc.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantization_numerics"):
        EngineConfig(quantization_numerics="a4")
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs a .gguf"):
        LLM(str(tiny_model_dir), tokenizer=str(bundled_tokenizer_dir), quantization="gguf")
    llm = LLM(str(tiny_model_dir), tokenizer=str(bundled_tokenizer_dir), max_model_len=64,
              num_gpu_blocks=8)
    assert llm.engine.quantization == "none"  # auto on a dense checkpoint
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())


def test_quant_linear_prefill_path_matches_kernel():
    """More than PREFILL_ROWS rows take the expand-and-GEMM path: same product."""
    from engine.models import quant_linear
    from engine.models.quant_linear import QuantWeight, quantize_q8_0

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 64, generator=gen)
    q = quantize_q8_0(w)
    dense = QuantWeight(torch.randn(10, 64, generator=gen), None, 10, 64)
    layer = QuantLinear([q, dense], torch.randn(80, generator=gen), "a32")
    x = torch.randn(quant_linear.PREFILL_ROWS + 5, 64, generator=gen)
    ref = torch.cat([x.double() @ cpu_quant.dequantize_rows(q.data, 8, 64).double().T,
                     x.double() @ dense.data.double().T], 1) + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x[:3]).double(), ref[:3], rtol=1e-5, atol=1e-4)


def test_a8_packed_layers_keep_the_integer_kernel_past_prefill_rows():
    """In a8 a packed layer multiplies any row count in the integer kernel (no expansion):
    each row is quantized on its own, so 150 rows at once equal the rows one at a time, bit
    for bit, and stay within a8's error of the float64 product. The one-call MLP too."""
    from engine.models import quant_linear
    from engine.models.quant_linear import QuantMLP, quantize_q8_0

    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen) * 0.1
    q = quantize_q8_0(w)
    layer = QuantLinear([q], None, "a8")
    assert layer.parts[0].packed
    rows = quant_linear.PREFILL_ROWS * 2 + 22
    x = torch.randn(rows, 64, generator=gen)
    y = layer(x)
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(y, one_by_one)
    ref = x.double() @ cpu_quant.dequantize_rows(q.data, 8, 64).double().T
    err = (y.double() - ref).abs().max().item()
    # NOTE: int8 activations: |x - q dx| <= dx / 2 = max|x| / 254 per 32 values
    assert 0 < err < 0.02 * ref.abs().max().item()
    gate_up = QuantLinear([quantize_q8_0(torch.randn(128, 64, generator=gen) * 0.1)], None, "a8")
    down = QuantLinear([quantize_q8_0(torch.randn(64, 64, generator=gen) * 0.1)], None, "a8")
    mlp = QuantMLP(gate_up, down, "silu")
    assert mlp.fits(x)
    assert torch.equal(mlp(x), torch.cat([mlp(x[i : i + 1]) for i in range(rows)]))
    a32 = QuantMLP(QuantLinear(gate_up.parts, None, "a32"), QuantLinear(down.parts, None, "a32"),
                   "silu")
    assert not a32.fits(x)  # a32 keeps expand + GEMM past PREFILL_ROWS
