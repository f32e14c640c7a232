"""The numerics `auto` picks (engine/models/numerics.py): llama.cpp's (a8, float16 KV) for a
GGUF kept quantized on the CPU, the exact ones (a32, the model dtype's KV) everywhere else, and
each one flag away from the other.

The reference for what each resolved mode computes is the same engine run with the mode spelled
out (the KL evidence for the choice is bench/RESULTS.md's); HF parity of a32 is
test_parity_bundled's and test_quantized's.
"""

from __future__ import annotations

import c_build
import pytest
import torch
from tiny_quant_gguf import write_tiny_gguf

from engine import LLM, SamplingParams
from engine.models.numerics import resolve_kv_dtype, resolve_numerics
from engine.models.quant_linear import QuantLinear
from ipc.config import EngineConfig
from kernels.cpu import quant as cpu_quant

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPTS = [[1, 422, 3110, 2706], [1] + list(range(300, 340))]


@pytest.fixture(autouse=True)
def _built() -> None:
    c_build.require(None if cpu_quant.available() else cpu_quant.build_error())


@pytest.fixture(scope="module")
def gguf_path(tiny_model_dir, tmp_path_factory):
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("q") / "tiny-Q4_1.gguf",
                           "Q4_1")


def _llm(model, tok_dir, **options) -> LLM:
    return LLM(str(model), tokenizer=str(tok_dir), max_model_len=256, num_gpu_blocks=64,
               **options)


def _numerics(llm: LLM) -> set[str]:
    return {m.numerics for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)}


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_a_quantized_gguf_defaults_to_a8_with_a_float16_cache(gguf_path, bundled_tokenizer_dir):
    default = _llm(gguf_path, bundled_tokenizer_dir)
    assert default.engine.quantization == "gguf"
    assert default.engine.numerics == "a8" and _numerics(default) == {"a8"}
    assert default.engine.kv_dtype == torch.float16
    assert {t.dtype for kv in default.engine.runner.kv_caches for t in kv} == {torch.float16}
    spelled = _llm(gguf_path, bundled_tokenizer_dir, quantization_numerics="a8",
                   kv_cache_dtype="float16")
    assert _tokens(default) == _tokens(spelled)


def test_a32_is_one_flag_away_and_keeps_a_float32_cache(gguf_path, bundled_tokenizer_dir):
    exact = _llm(gguf_path, bundled_tokenizer_dir, quantization_numerics="a32")
    assert _numerics(exact) == {"a32"} and exact.engine.kv_dtype == torch.float32
    a8_f32 = _llm(gguf_path, bundled_tokenizer_dir, quantization_numerics="a8",
                  kv_cache_dtype="float32")
    assert _numerics(a8_f32) == {"a8"} and a8_f32.engine.kv_dtype == torch.float32


def test_dense_models_keep_the_exact_numerics(tiny_model_dir, gguf_path, bundled_tokenizer_dir):
    dense = _llm(tiny_model_dir, bundled_tokenizer_dir)
    assert dense.engine.quantization == "none" and dense.engine.kv_dtype == torch.float32
    int8 = _llm(tiny_model_dir, bundled_tokenizer_dir, quantization="int8")
    assert _numerics(int8) == {"a32"} and int8.engine.kv_dtype == torch.float32
    dequantized = _llm(gguf_path, bundled_tokenizer_dir, quantization="none")
    assert dequantized.engine.kv_dtype == torch.float32


def test_the_rules_and_their_errors() -> None:
    assert resolve_numerics("auto", "gguf") == "a8"
    assert [resolve_numerics("auto", q) for q in ("none", "int8")] == ["a32", "a32"]
    assert resolve_numerics("a32", "gguf") == "a32"
    assert resolve_kv_dtype("auto", "a32", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", "a8", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype float32 needs a float32 model"):
        resolve_kv_dtype("float32", "a32", torch.bfloat16)
    with pytest.raises(ValueError, match="quantization_numerics must be one of"):
        EngineConfig(quantization_numerics="a16")
    assert EngineConfig().quantization_numerics == "auto"
