"""The same request gives the same logits, bit for bit, whatever else the engine does: random
schedules (batch mates and their order, prefill chunk sizes, a warm or cold prefix cache,
preemption by recompute or swap, n-gram speculation, one thread or two) on the bundled model in
its default numerics (a8 products, float16 KV cache), against the request run alone and cold.

What makes it hold: the a8 products are row-local (int8 sums are exact), and attention, decode
and prefill alike, runs in the decode kernel, whose split of a sequence's keys depends on its
own length only (kernels/cpu/csrc/decode.c, kernels/attention/cpu_backend.py `prefills`).
Before, a batch mate or a thread count changed a decode's split and a prefill chunk's shape
changed SDPA's blocking, and a8's int8 rounding made those last-bit differences 0.3-0.6 logits.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.invariance import capture
from engine import LLM

WORDS = ("the of and to in is was for on that with as by at from his her it an are river city "
         "people music light winter garden letter").split()
MAX_TOKENS = 6


def _prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _logits(llm: LLM, prompts: list[str], watched: int
            ) -> tuple[list[torch.Tensor], list[int]]:
    """Each sampling step's raw logits of prompt `watched` (the prompts submitted together),
    and its tokens (bench/invariance.py's capture)."""
    run = capture(llm, prompts, MAX_TOKENS)
    return run.logits[watched], run.tokens[watched]


@pytest.fixture(scope="module")
def alone() -> dict[tuple, tuple[list[torch.Tensor], list[int]]]:
    """Reference logits: each watched prompt alone, cold, on a default engine."""
    return {}


@pytest.fixture(scope="module")
def engines() -> dict[tuple, LLM]:
    return {}


def _engine(engines: dict[tuple, LLM], **options) -> LLM:
    key = tuple(sorted(options.items()))
    if key not in engines:
        engines[key] = LLM(None, **options)
    return engines[key]


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(watched_seed=st.integers(0, 3), watched_words=st.sampled_from([40, 150, 330]),
       mates=st.lists(st.tuples(st.integers(10, 99), st.sampled_from([5, 60, 200])),
                      max_size=3),
       position=st.integers(0, 3), chunk=st.sampled_from([None, 48, 100]),
       warm=st.booleans(), blocks=st.sampled_from([None, 48]),
       preemption=st.sampled_from(["recompute", "swap"]), ngram=st.booleans(),
       threads=st.sampled_from([1, 2]))
def test_logits_are_the_same_bits_in_any_schedule(alone, engines, watched_seed, watched_words,
                                                  mates, position, chunk, warm, blocks,
                                                  preemption, ngram, threads) -> None:
    prompt = _prompt(watched_seed, watched_words)
    key = (watched_seed, watched_words)
    if key not in alone:
        alone[key] = _logits(LLM(None, enable_prefix_caching=False), [prompt], 0)
    options: dict = {"num_threads": threads}
    if chunk is not None:
        options["max_num_batched_tokens"] = chunk
    if blocks is not None:  # NOTE: too few blocks for the batch: preemption
        options.update(num_gpu_blocks=blocks, preemption_mode=preemption)
    if ngram:
        options.update(speculative_method="ngram", num_speculative_tokens=3)
    llm = _engine(engines, **options)
    if warm:
        _logits(llm, [prompt], 0)
    prompts = [_prompt(s, w) for s, w in mates]
    position = min(position, len(prompts))
    prompts.insert(position, prompt)
    got, tokens = _logits(llm, prompts, position)
    ref, ref_tokens = alone[key]
    assert tokens == ref_tokens
    if ngram:
        return  # NOTE: its verify steps' logits are not recorded (greedy tokens are the promise)
    assert len(got) == MAX_TOKENS
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (
        [float((a - b).abs().max()) for a, b in zip(ref, got, strict=True)])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_logits_are_the_same_bits_through_preemption(alone, mode: str) -> None:
    prompt = _prompt(0, 330)
    key = (0, 330)
    if key not in alone:
        alone[key] = _logits(LLM(None, enable_prefix_caching=False), [prompt], 0)
    # NOTE: four prompts of 23-24 blocks each in a pool of 60: the latest, the watched one,
    # is preempted when the others' decodes need its blocks
    llm = LLM(None, num_gpu_blocks=60, preemption_mode=mode, enable_prefix_caching=False)
    prompts = [_prompt(s, 330) for s in (11, 12, 13)] + [prompt]
    got, tokens = _logits(llm, prompts, 3)
    assert llm.engine.stats().num_preemptions > 0
    ref, ref_tokens = alone[key]
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
