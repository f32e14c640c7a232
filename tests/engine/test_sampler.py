"""Sampler: seeded reproducibility across batches, the support of top-k/top-p/min-p, penalties
as defined, min_tokens, and logprobs."""

from __future__ import annotations

import numpy as np
import torch

from engine.run.rows import Row
from engine.run.sampler import Sampler
from engine.step_plan import NewRequest
from ipc.sampling import SamplingParams

V = 50


def req(params: SamplingParams, prompt=(1, 2, 3), output=(), seed=None, ends=()) -> Row:
    """The runner's row of a request with these tokens (the sampler reads rows); `ends`: the
    tokens the plan says end it (EOS and stop_token_ids)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    new = NewRequest("r", [*prompt, *output], len(prompt), params, seed, [], 0, list(ends))
    return Row(new, 0, gen)


def fixed_logits(rows: int) -> torch.Tensor:
    # token i has logit -0.1 * i: a smooth, strictly decreasing distribution
    return (-0.1 * torch.arange(V, dtype=torch.float32)).repeat(rows, 1)


def sample_many(params: SamplingParams, n: int = 400) -> set[int]:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    reqs = [req(params) for _ in range(n)]
    return set(sampler(fixed_logits(n), reqs).token_ids)


def test_greedy_is_argmax():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(4, V)
    out = sampler(logits, [req(SamplingParams(temperature=0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seed_gives_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    alone = Sampler(seed=0, device=torch.device("cpu"))
    crowd = Sampler(seed=99, device=torch.device("cpu"))
    r1, r2 = req(params, seed=1234), req(params, seed=1234)
    seq_alone, seq_crowd = [], []
    for _ in range(20):
        seq_alone += alone(logits, [r1]).token_ids
        others = [req(SamplingParams(temperature=0.8)) for _ in range(5)]
        batch = torch.cat([torch.randn(2, V), logits, torch.randn(3, V)])
        seq_crowd.append(crowd(batch, others[:2] + [r2] + others[2:]).token_ids[2])
    assert seq_alone == seq_crowd
    assert len(set(seq_alone)) > 1  # it is sampling, not argmax


def test_top_k_keeps_only_the_k_most_likely():
    assert sample_many(SamplingParams(temperature=5.0, top_k=3)) == {0, 1, 2}


def test_top_p_keeps_the_nucleus():
    probs = fixed_logits(1)[0].softmax(-1)
    cum = probs.cumsum(0)
    nucleus = int((cum < 0.5).sum()) + 1  # smallest prefix reaching 0.5
    got = sample_many(SamplingParams(temperature=1.0, top_p=0.5), n=800)
    assert got <= set(range(nucleus))
    assert len(got) > 1


def test_min_p_drops_tokens_below_the_floor():
    # p_i / p_0 = exp(-0.1 i) >= 0.5  <=>  i <= 6.93
    got = sample_many(SamplingParams(temperature=1.0, min_p=0.5), n=800)
    assert got <= set(range(7)) and 0 in got


def test_penalties_change_logits_as_defined():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    r = req(params, prompt=[0], output=[1, 2, 2])
    got = sampler._apply_penalties(logits, [r])[0]
    # token 0: in the prompt only -> 2 / 2; token 1: output once -> -2 * 2 - 0.5 - 0.25
    # token 2: output twice -> 1 / 2 - 1.0 - 0.25; tokens 3, 4 untouched
    expected = torch.tensor([1.0, -4.75, -0.75, 0.5, 0.0])
    torch.testing.assert_close(got, expected)


def test_min_tokens_suppresses_eos_and_stop_ids():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))
    ends = (0, 1)  # EOS 0 and stop id 1
    assert sampler(logits, [req(params, output=[2], ends=ends)]).token_ids == [2]
    assert sampler(logits, [req(params, output=[2, 2], ends=ends)]).token_ids == [0]


def test_a_grammar_that_allows_only_eos_wins_over_min_tokens():
    # NOTE: the grammar allows token 0 (EOS) only; min_tokens bans it; the row must still
    # sample a token the grammar allows, not the argmax of an all -inf row (token 0 by
    # accident in one case, any token in another)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[9.0, 1.0, 5.0, 7.0]])
    params = SamplingParams(temperature=0, min_tokens=5)
    row = req(params, ends=(2,))  # EOS 2
    row.grammar_mask = np.array([[1 << 2]], dtype=np.int32)  # only token 2 (EOS) allowed
    assert sampler(logits, [row]).token_ids == [2]
    # with the grammar allowing EOS and token 3, min_tokens bans EOS and 3 is sampled
    row.grammar_mask = np.array([[(1 << 2) | (1 << 3)]], dtype=np.int32)
    assert sampler(logits, [row]).token_ids == [3]


def test_logprobs_of_sampled_and_top_tokens():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sampler(logits, [req(SamplingParams(temperature=0, logprobs=2))])
    lp = logits.log_softmax(-1)[0]
    pos = out.logprobs[0]
    assert pos.token_id == 1 and pos.rank == 1
    assert abs(pos.logprob - float(lp[1])) < 1e-6
    assert [t.token_id for t in pos.top] == [1, 2]
    assert sampler(logits, [req(SamplingParams(temperature=0))]).logprobs == [None]


def test_logit_bias_is_added_before_sampling():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    # token 0 is the greedy one; -100 bans it, +100 on token 7 makes 7 certain
    banned = req(SamplingParams(temperature=0, logit_bias=((0, -100.0),)))
    boosted = req(SamplingParams(temperature=1.0, logit_bias=((7, 100.0),)))
    plain = req(SamplingParams(temperature=0))
    out = sampler(fixed_logits(3), [banned, boosted, plain])
    assert out.token_ids == [1, 7, 0]


def test_tiny_temperature_and_top_p_never_sample_from_a_nan_row():
    # NOTE: random logits with a clear maximum away from id 0 (a NaN row's argmax is id 0)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(7)) * 8
    logits[0, 777] = 60.0
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    cases = [SamplingParams(temperature=t) for t in (1e-38, 1e-45, 1e-300, 1e-6)]
    cases += [SamplingParams(temperature=t, top_p=p) for t in (1.0, 1e-3)
              for p in (1e-300, 1e-45, 1e-9)]
    for params in cases:
        if not params.greedy:
            probs = sampler.probs(logits, [params])
            assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5, params
        tokens = {sampler(logits, [req(params)]).token_ids[0] for _ in range(20)}
        assert tokens == {777}, params  # what greedy gives
    assert sampler(logits, [req(SamplingParams(temperature=0))]).token_ids == [777]
