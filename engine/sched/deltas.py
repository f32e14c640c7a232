"""Token deltas from requests' scheduling state: the one place a choice's progress becomes
what the engine sends (tokens, finish, logprobs, prompt logprobs once, timeline metrics)."""

from __future__ import annotations

from engine.sched.beams import Hypothesis
from engine.sched.request import Request
from ipc.messages import RequestMetrics, TokenDelta


def delta(req: Request, tokens: list[int], logprobs=None) -> TokenDelta:
    """The delta of a choice that appended `tokens` (terminal once it finished)."""
    prompt = None
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and tokens:
        prompt, req.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, [], True
    return TokenDelta(
        prompt_logprobs=prompt,
        request_id=req.request_id,
        new_token_ids=tokens,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        index=req.index,
        cumulative_logprob=req.cumulative_logprob if req.sampling.best_of else None,
        scheduled_time=req.scheduled_time if req.num_output_tokens == len(tokens) else None,
        metrics=_metrics(req) if req.finish_reason is not None else None,
        error=req.error if req.finish_reason is not None else None,
        error_param=req.error_param if req.finish_reason is not None else None,
        pooled=req.pooled,
        forced_closing=req.closing.forced and bool(tokens),
    )


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        scheduled_time=req.scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=req.finished_time,
        num_preemptions=req.num_preemptions,
        num_recomputed_tokens=req.num_recomputed_tokens,
        num_spec_draft_tokens=req.num_spec_draft_tokens,
        num_spec_accepted_tokens=req.num_spec_accepted_tokens,
    )


def _group_metrics(group: list[Request]) -> RequestMetrics:
    """A beam group's metrics: its earliest times and its summed work."""
    firsts = [r.first_token_time for r in group if r.first_token_time is not None]
    return RequestMetrics(
        scheduled_time=group[0].scheduled_time,
        first_token_time=min(firsts, default=None),
        finished_time=max(r.finished_time for r in group),
        num_preemptions=sum(r.num_preemptions for r in group),
        num_recomputed_tokens=sum(r.num_recomputed_tokens for r in group),
    )


def beam_deltas(rid: str, top: list[Hypothesis], group: list[Request]) -> list[TokenDelta]:
    """A finished beam group's terminal deltas, one per best hypothesis."""
    first = group[0]
    # NOTE: a hypothesis is not one beam: the group's totals stand for each
    return [TokenDelta(request_id=rid, new_token_ids=h.token_ids, index=i,
                       finish_reason="stop" if h.finished else "length",
                       cumulative_logprob=h.score, num_prompt_tokens=first.num_prompt_tokens,
                       num_cached_tokens=first.num_cached_tokens,
                       metrics=_group_metrics(group))
            for i, h in enumerate(top)]
