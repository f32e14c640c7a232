"""Greedy agreement of two runs' outputs (engine RequestOutputs with logprobs), for the tests
that report how close an inexact mode (a8 products, a float16 KV cache) stays to its reference.
A plain module, imported by name as tests/tiny_llama.py is."""

from __future__ import annotations


def greedy_agreement(outs, refs) -> tuple[int, int, float]:
    """(tokens equal before each output's first difference, all reference tokens, the largest
    log-prob difference over the tokens both logprob dicts hold at those positions)."""
    same = total = 0
    worst = 0.0
    for x, y in zip(outs, refs, strict=True):
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if s != t:
                break
            same += 1
            common = x.logprobs[i].keys() & y.logprobs[i].keys()
            worst = max(worst, *(abs(x.logprobs[i][k] - y.logprobs[i][k]) for k in common))
        total += len(y.token_ids)
    return same, total, worst
