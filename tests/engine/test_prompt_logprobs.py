"""Prompt logprobs equal HF transformers' log_softmax over the same tokens, also when the
prompt is prefilled in chunks and when its blocks are already in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPT = [1, *range(300, 339)]  # 40 tokens: three prefill chunks of 16 below


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=64,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """HF's log_softmax at every position of PROMPT: [len(PROMPT), vocab], float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return logits.double().log_softmax(-1)


def _check(prompt_logprobs, reference: torch.Tensor, k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        row = reference[j - 1]
        got = prompt_logprobs[j]
        assert got[PROMPT[j]] == pytest.approx(float(row[PROMPT[j]]), abs=1e-4)
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(got)
        for t in top:
            assert got[t] == pytest.approx(float(row[t]), abs=1e-4)


def test_prompt_logprobs_equal_hf_in_chunks(llm: LLM, reference: torch.Tensor) -> None:
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    _check(out.prompt_logprobs, reference, 2)


def test_prompt_logprobs_after_a_prefix_cache_hit(llm: LLM, reference: torch.Tensor) -> None:
    warm = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0]
    again = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0]
    assert warm.prompt_logprobs is None and again.num_cached_tokens > 0  # the cache is warm
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, n=2, temperature=1.0))[0]
    _check(out.prompt_logprobs, reference, 0)
    assert llm.engine.kv.num_free_blocks == 64  # everything freed
