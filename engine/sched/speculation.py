"""Speculative decoding: the n-gram proposer, the accept/reject rule that keeps the target's
distribution exactly, and per-request adaptive gamma. The self-draft proposer runs in the
runner (it needs the model); its proposals come here to be verified like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Adaptive gamma: an exponential average of the acceptance rate halves gamma when drafts are
# mostly rejected (0 stops speculating) and raises it by one when they are accepted.
_EMA = 0.5
_LOW, _HIGH = 0.35, 0.7
_PROBE_EVERY = 32  # plain decode steps before a request that stopped speculating tries again


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


def verify(
    draft: list[int],
    target: torch.Tensor,  # [g + 1, vocab]: greedy -> logits; else the processed probabilities
    draft_probs: torch.Tensor | None,  # [g, vocab]: the draft's probabilities; None = one-hot
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted draft tokens, the token after them) for one request.

    Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x_i,
    drawn from p_i, is kept with probability min(1, q_i(x_i) / p_i(x_i)). At the first
    rejection the next token is drawn from norm(max(0, q_i - p_i)), and nothing after it is
    kept; if every draft is kept, a bonus token is drawn from q_g. The result is distributed
    exactly as sampling from q alone. A one-hot p (n-gram lookup) keeps x_i with probability
    q_i(x_i) and resamples from q_i without x_i. Greedy keeps x_i iff it is q_i's argmax.
    """
    if greedy:
        best = target.argmax(dim=-1).tolist()
        for i, token in enumerate(draft):
            if best[i] != token:
                return i, best[i]
        return len(draft), best[len(draft)]
    u = torch.rand(len(draft), generator=generator, device=target.device).tolist()
    for i, token in enumerate(draft):
        q = target[i]
        p_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        # NOTE: strict `<`: a token with q = 0 (a grammar refuses it) is never kept, even at u = 0
        if p_token > 0 and u[i] < float(q[token]) / p_token:
            continue
        if draft_probs is None:
            residual = q.clone()
            residual[token] = 0.0
        else:
            residual = (q - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else q
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return len(draft), int(torch.multinomial(target[len(draft)], 1, generator=generator))


def adapt_gamma(req, proposed: int, accepted: int, gamma_max: int) -> None:
    """Move the request's gamma by its recent acceptance rate."""
    rate = accepted / proposed if proposed else 0.0
    req.spec_ema = _EMA * req.spec_ema + (1 - _EMA) * rate
    if req.spec_ema < _LOW:
        req.spec_gamma //= 2  # NOTE: a wasted draft costs gamma draft steps: back off fast
    elif req.spec_ema > _HIGH:
        req.spec_gamma = min(gamma_max, req.spec_gamma + 1)


def next_gamma(req, gamma_max: int) -> int:
    """Gamma for this step; a request at 0 probes with 1 every _PROBE_EVERY steps."""
    if req.spec_gamma > 0:
        return req.spec_gamma
    req.spec_idle += 1
    if req.spec_idle >= _PROBE_EVERY:
        req.spec_idle, req.spec_gamma, req.spec_ema = 0, 1, 0.5
        return 1
    return 0
