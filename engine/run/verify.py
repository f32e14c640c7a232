"""Speculative verification on the compute side: modified rejection sampling keeps the target's
distribution exactly, whatever the drafts' proposer (n-gram lookup, self draft, draft model)."""

from __future__ import annotations

import torch


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
