"""The speculation policy on the scheduling side: which choices draft, how many tokens (an
adaptive gamma per choice), the n-gram proposer, and what a verify step's result means. The
verification math is the runner's (engine/run/verify.py); the self draft proposes there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched import grammar
from engine.sched.request import Request

# Adaptive gamma: an exponential average of the acceptance rate halves gamma when drafts are
# mostly rejected (0 stops speculating) and raises it by one when they are accepted.
_EMA = 0.5
_LOW, _HIGH = 0.35, 0.7
_PROBE_EVERY = 32  # plain decode steps before a request that stopped speculating tries again


@dataclass(frozen=True)
class SpecConfig:
    method: str  # ngram | self | draft
    num_tokens: int  # gamma at most
    lookup_max: int = 4  # ngram sizes tried, longest first
    lookup_min: int = 1


@dataclass
class SpecStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at i

    def record(self, proposed: int, accepted: int) -> None:
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.verify_steps += 1
        while len(self.accepted_by_position) < proposed:
            self.accepted_by_position.append(0)
        for i in range(accepted):
            self.accepted_by_position[i] += 1


@dataclass
class GammaState:
    """One choice's adaptive gamma (kept by key from its first speculation)."""

    gamma: int
    ema: float = 0.5  # recent acceptance rate
    idle: int = 0  # plain steps since gamma fell to 0


@dataclass(frozen=True)
class Proposal:
    """Drafts for one choice this step: `tokens` (n-gram lookup), or `gamma` tokens that the
    runner's own draft proposes first (self or draft model; then `tokens` is empty)."""

    tokens: list[int]
    gamma: int = 0

    @property
    def num_tokens(self) -> int:
        return self.gamma or len(self.tokens)


class Speculation:
    """Decides drafts (`propose`) and reads verification (`settle`); the scheduler applies both
    (plan entries, computed-token rollback, block trimming)."""

    def __init__(self, config: SpecConfig | None, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._gamma: dict[str, GammaState] = {}  # by choice key

    def propose(self, req: Request, room: int) -> Proposal | None:
        """Drafts for a decoding choice with `room` tokens of budget after its own (None when
        it does not speculate now)."""
        spec = self.config
        if spec is None or not can_speculate(req):
            return None
        state = self._gamma.setdefault(req.key, GammaState(spec.num_tokens))
        left = min(req.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens) - 1
        gamma = min(next_gamma(state), room, left)
        if gamma <= 0:
            return None
        if spec.method != "ngram":
            # NOTE: the runner's draft proposes them in the first phase of this step
            # (Runner.propose, then Scheduler.attach_drafts): no placeholder tokens here
            return Proposal([], gamma)
        drafts = ngram_propose(req.all_token_ids, gamma, spec.lookup_max, spec.lookup_min)
        if req.grammar is not None:
            # NOTE: a lookup proposal is a function of the context alone, so cutting it
            # where the grammar would refuse it keeps verification exact.
            drafts = drafts[: req.grammar.valid_prefix(drafts)]
        return Proposal(drafts) if drafts else None

    def settle(self, key: str, proposed: int, accepted: int) -> int:
        """Count a verify step and adapt the choice's gamma; returns how many computed
        positions (the rejected drafts') the scheduler rolls back."""
        assert self.config is not None
        self.stats.record(proposed, accepted)
        adapt_gamma(self._gamma[key], proposed, accepted, self.config.num_tokens)
        return proposed - accepted

    def forget(self, key: str) -> None:
        self._gamma.pop(key, None)


def can_speculate(req: Request) -> bool:
    s = req.sampling
    return (s.n == 1 and not s.best_of and not s.use_beam_search and s.logprobs is None
            and not s.logit_bias and not s.has_penalty
            # NOTE: budget closing checks each token as it is sampled; drafts skip that check
            and not grammar.closes_on_budget(req)
            and req.num_output_tokens >= s.min_tokens and req.num_output_tokens > 0)


def ngram_propose(tokens: list[int], gamma: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: find the last n tokens (longest n first) earlier in the context and
    propose up to gamma tokens that followed that occurrence (the most recent one)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + gamma]
                if follow:
                    return follow
    return []


def adapt_gamma(state: GammaState, proposed: int, accepted: int, gamma_max: int) -> None:
    """Move the choice's gamma by its recent acceptance rate."""
    rate = accepted / proposed if proposed else 0.0
    state.ema = _EMA * state.ema + (1 - _EMA) * rate
    if state.ema < _LOW:
        state.gamma //= 2  # NOTE: a wasted draft costs gamma draft steps: back off fast
    elif state.ema > _HIGH:
        state.gamma = min(gamma_max, state.gamma + 1)


def next_gamma(state: GammaState) -> int:
    """Gamma for this step; a choice at 0 probes with 1 every _PROBE_EVERY steps."""
    if state.gamma > 0:
        return state.gamma
    state.idle += 1
    if state.idle >= _PROBE_EVERY:
        state.idle, state.gamma, state.ema = 0, 1, 0.5
        return 1
    return 0
