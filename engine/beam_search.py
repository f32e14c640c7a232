"""Beam search over a group of width k: pick the k best continuations of the live beams from
their top-2k candidates, and rank finished and live hypotheses at the end.

Pure selection logic; the scheduler forks and frees the beams' KV blocks (copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hypothesis:
    token_ids: list[int]  # output tokens
    score: float  # sum of logprobs
    finished: bool  # ended with EOS or a stop token

    def normalized(self, length_penalty: float) -> float:
        return self.score / max(1, len(self.token_ids)) ** length_penalty


@dataclass
class Continuation:
    parent: int  # index of the live beam it extends
    token_id: int
    score: float


def select(
    beams: list[tuple[list[int], float, list[tuple[int, float]]]],
    width: int,
    ends: frozenset[int],
    can_end: list[bool],
) -> tuple[list[Continuation], list[Hypothesis]]:
    """beams: (output tokens, score, top candidates (token, logprob)) per live beam.

    Returns up to `width` continuations, best first, and the hypotheses that ended this step
    (a candidate in `ends` closes its beam when `can_end` allows it, i.e. past min_tokens).
    """
    candidates = sorted(
        ((score + lp, b, tok) for b, (_, score, top) in enumerate(beams) for tok, lp in top),
        key=lambda c: -c[0],
    )
    chosen: list[Continuation] = []
    ended: list[Hypothesis] = []
    for total, b, tok in candidates:
        if tok in ends:
            if can_end[b] and len(ended) < width:
                ended.append(Hypothesis(beams[b][0] + [tok], total, True))
            continue
        chosen.append(Continuation(b, tok, total))
        if len(chosen) == width:
            break
    return chosen, ended


def done(
    finished: list[Hypothesis], best_live: float, live_len: int, width: int,
    length_penalty: float,
) -> bool:
    """Stop early once `width` hypotheses have ended and the best live beam ranks below them.

    NOTE: a heuristic bound (as HF's early_stopping=False): scores only fall as beams grow,
    but length normalization can lift them a little.
    """
    if len(finished) < width:
        return False
    worst = sorted(h.normalized(length_penalty) for h in finished)[-width]
    return best_live / max(1, live_len) ** length_penalty < worst


def best(hypotheses: list[Hypothesis], width: int, length_penalty: float) -> list[Hypothesis]:
    return sorted(hypotheses, key=lambda h: -h.normalized(length_penalty))[:width]
