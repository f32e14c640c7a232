"""Continuous batching by token budget: every request catches its computed tokens up to its
tokens, so chunked prefill and decode are one rule. Preemption (by recompute) is what happens
when the KV manager cannot make room.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampler import SamplerOutput
from ipc.messages import TokenDelta


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class SchedulerOutput:
    """The scheduler -> runner contract for one step."""

    # (request, number of new tokens to compute), requests with one new token first
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # requests whose last scheduled token completes them: the runner samples one token for each
    sampling: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: Sequence[int]
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.running: list[Request] = []  # sorted by sort_key
        self._waiting: list[tuple[tuple, Request]] = []  # heap by sort_key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        heapq.heappush(self._waiting, (request.sort_key, request))

    def abort(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Finish live requests as aborted, freeing their blocks now; unknown ids are ignored."""
        deltas = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                deltas.append(_delta(req, []))
        return deltas

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.scheduled.sort(key=lambda item: item[1] != 1)  # one-token queries first
        out.sampling = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted: it was the last one
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running[-1]  # lowest priority, newest
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._waiting[0][1]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, n):
                break
            heapq.heappop(self._waiting)
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            out.scheduled.append((req, n))
            budget -= n

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def _preempt(self, req: Request) -> None:
        # NOTE: recompute: the request's tokens so far (prompt + output) are computed again
        # when it is readmitted; its output is kept, so nothing is lost or repeated.
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (req.sort_key, req))

    # ---- update ----------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> list[TokenDelta]:
        """Advance progress, append sampled tokens, finish what stopped; deltas for the caller."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
        if sampled is None:
            return []
        deltas = []
        for req, token, logprobs in zip(out.sampling, sampled.token_ids, sampled.logprobs,
                                        strict=True):
            req.append_token(token)
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
            deltas.append(_delta(req, [token], None if logprobs is None else [logprobs]))
        return deltas

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        s = req.sampling
        if req.num_output_tokens > s.min_tokens:
            if not s.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in s.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self._waiting.remove((req.sort_key, req))
            heapq.heapify(self._waiting)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]


def _delta(req: Request, tokens: list[int], logprobs=None) -> TokenDelta:
    return TokenDelta(
        request_id=req.request_id,
        new_token_ids=tokens,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
    )
