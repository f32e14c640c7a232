"""Beam search over a group of width k: pick the k best continuations of the live beams from
their top-2k candidates, and rank finished and live hypotheses at the end.

Pure decisions: `plan_step` says which members keep, fork, park and what ended; `final` says
when the group is done. The scheduler applies them with the fork and free calls it uses for
n > 1 (copy-on-write blocks).
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


@dataclass
class Member:
    """What the beam module sees of one member (choice) of a group."""

    token_ids: list[int]  # output tokens
    score: float  # sum of logprobs
    candidates: list[tuple[int, float]] | None  # (token, logprob) sampled this step; None: not
    live: bool  # running (it holds blocks); parked members are spares


@dataclass
class BeamStep:
    """One step's decisions, by member index; applied in this order: park, fork, append."""

    park: list[int]  # members with no continuation: they free their blocks
    forks: list[tuple[int, int]]  # (spare member, parent member): the spare becomes a copy
    # (member, token, new score): the token each continuing member appends (forks included)
    append: list[tuple[int, int, float]]
    ended: list[Hypothesis]  # hypotheses that ended this step


def plan_step(members: list[Member], width: int, ends: frozenset[int],
              min_tokens: int) -> BeamStep | None:
    """Keep the `width` best continuations of the live members: a member continued once
    keeps its place, one continued twice is copied into a spare; None until every live
    member has its candidates (a sibling was preempted: select when it catches up)."""
    live = [i for i, m in enumerate(members) if m.live]
    if any(members[i].candidates is None for i in live):
        return None
    unique: dict[tuple[int, ...], int] = {}
    for i in live:  # right after the prompt all k beams are the same beam
        unique.setdefault(tuple(members[i].token_ids), i)
    parents = list(unique.values())
    beams = [(members[i].token_ids, members[i].score, members[i].candidates or [])
             for i in parents]
    can_end = [len(members[i].token_ids) + 1 > min_tokens for i in parents]
    chosen, ended = select(beams, width, ends, can_end)
    keep: dict[int, Continuation] = {}
    extra: list[Continuation] = []
    for c in chosen:
        if c.parent in keep:
            extra.append(c)  # a second continuation of one beam: fork a spare into it
        else:
            keep[c.parent] = c
    keepers = {parents[p] for p in keep}
    spares = [i for i in range(len(members)) if i not in keepers]
    step = BeamStep(list(spares), [], [(parents[p], c.token_id, c.score)
                                       for p, c in keep.items()], ended)
    for c in extra:
        spare = spares.pop()
        step.forks.append((spare, parents[c.parent]))
        step.append.append((spare, c.token_id, c.score))
    return step


def final(finished: list[Hypothesis], live: list[Member], width: int, length_penalty: float,
          at_limit: bool) -> list[Hypothesis] | None:
    """The group's `width` best hypotheses once it is done (no live member, a length limit
    reached, or no live member can beat the ended ones); None while it goes on."""
    out_len = max((len(m.token_ids) for m in live), default=0)
    best_live = max((m.score for m in live), default=float("-inf"))
    if live and not at_limit and not done(finished, best_live, out_len, width, length_penalty):
        return None
    hyps = finished + [Hypothesis(m.token_ids, m.score, False) for m in live]
    return best(hyps, width, length_penalty)
