"""A Llama 3.x GGUF carries its llama3 RoPE scaling as the `rope_freqs.weight` tensor (one
factor per rotary pair, as llama.cpp's converter writes it), not as config keys. Loaded from
such a file, the prompt logprobs equal HF transformers' log_softmax of the safetensors
checkpoint with llama3 rope_scaling; the same file without the tensor gives others (the
factors matter at these positions, so the comparison can see them dropped)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import build_family
from tiny_gguf import write_gguf

from engine import LLM, SamplingParams
from engine.models.llama import rope_inv_freq

TOL = 1e-4  # float32 against float32
TOP = 3


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, bundled_tokenizer_dir):
    return build_family("llama3", tmp_path_factory.mktemp("llama3"), bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, 49000, (150,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_logprobs(llama3, prompt) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama3, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)


def _prompt_logprobs(path, tokenizer_dir, prompt) -> tuple[LLM, list[dict[int, float]]]:
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), quantization_numerics="a32")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    return llm, out.prompt_logprobs


def _worst(got: list[dict[int, float]], ref: torch.Tensor, prompt: list[int]) -> float:
    """The largest gap between a returned prompt logprob and HF's."""
    return max(abs(v - float(ref[j - 1, t])) for j in range(1, len(prompt))
               for t, v in got[j].items())


def test_rope_freqs_give_hf_llama3_logprobs(llama3, prompt, hf_logprobs, tmp_path,
                                            monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(llama3, tmp_path / "llama3.gguf", "llama")
    llm, got = _prompt_logprobs(path, llama3, prompt)
    cfg = llm.engine.model_config
    assert cfg.rope_scaling["rope_type"] == "freq_factors"
    hf = AutoModelForCausalLM.from_pretrained(llama3, dtype=torch.float32)
    torch.testing.assert_close(rope_inv_freq(cfg)[0], hf.model.rotary_emb.inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert _worst(got, hf_logprobs, prompt) < TOL


def test_without_rope_freqs_the_logprobs_differ(llama3, prompt, hf_logprobs, tmp_path,
                                                monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(llama3, tmp_path / "plain.gguf", "llama", rope_freqs=False)
    llm, got = _prompt_logprobs(path, llama3, prompt)
    assert llm.engine.model_config.rope_scaling is None
    assert _worst(got, hf_logprobs, prompt) > 100 * TOL
