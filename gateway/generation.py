"""One request's path through the gateway: submit, detokenize, match stop strings, count, abort.

Both the HTTP handlers and the WebSocket session consume a `Generation` as an async iterator of
`Piece`s (None while nothing arrived for `tick` seconds, so SSE can send `: ping`; a `tick` of
None never yields None).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from gateway.errors import ApiError
from gateway.metrics import Metrics
from ipc.messages import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    AddRequest,
    EngineReady,
    EngineStats,
    LoadLoraAdapter,
    LoraAdapterResult,
    PositionLogprobs,
    RequestMetrics,
    TokenDelta,
    UnloadLoraAdapter,
)
from ipc.sampling import SamplingParams
from ipc.text import ChoiceText

log = structlog.get_logger("pagedserve.request")
# the finish_reason label of a request the engine refused as the client's fault (a 400 naming
# the field: a grammar it could not compile): not an engine "error"
FINISH_INVALID = "invalid"


class RequestStreamLike(Protocol):
    request_id: str

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def aclose(self) -> None: ...


class EngineClientLike(Protocol):
    """What the gateway needs of `gateway.engine_client.EngineClient` (tests pass a double)."""

    ready: bool
    info: EngineReady | None
    stats: EngineStats | None
    num_inflight: int
    engine_stats: list[tuple[str, EngineStats | None]]  # per engine (data parallel: several)

    def submit(self, msg: AddRequest) -> RequestStreamLike: ...

    def abort(self, request_id: str) -> None: ...

    def abort_choice(self, request_id: str, index: int) -> None: ...

    async def lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterResult: ...


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str
    kind: str  # "chat" | "completion", or a pooling request's: "embedding" | "rerank" | "score"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    include_usage: bool = False
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    lora_name: str | None = None  # the LoRA adapter its `model` named (None: the base model)
    arrival: float = field(default_factory=time.time)
    trace_headers: dict[str, str] = field(default_factory=dict)  # traceparent of the caller
    created: int = field(default_factory=lambda: int(time.time()))
    echo: str = ""  # text shown before each choice's output (the request's `echo`)
    response_id: str | None = None  # the response's id when it differs (batched prompts)
    index_base: int = 0  # the response's index of choice 0 (batched prompts: p * n)
    show_prompt_logprobs: bool = False  # the client asked vLLM's prompt_logprobs
    tool_parser: Callable[[], Any] | None = None  # splits replies into content and tool calls
    # splits replies into reasoning and answer (gateway/choice_events.py ReasoningParser)
    reasoning_parser: Callable[[], Any] | None = None


@dataclass
class Piece:
    """New text of choice `index` (stop strings held back) and the tokens behind it;
    `finish_reason` set is that choice's last piece."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0
    cumulative_logprob: float | None = None  # with best_of: the choice's total so far
    error_param: str | None = None  # the request field at fault (a grammar that failed)
    pooled: list[float] | None = None  # a pooling request's vector, on its last piece
    forced: bool = False  # its tokens were forced by budget closing (TokenDelta.forced_closing)


def piece_error(piece: Piece) -> ApiError:
    """The client's error for a piece that ended in FINISH_ERROR: 400 naming the field when
    the request was at fault (a grammar the engine refused), else 500."""
    if piece.error_param is not None:
        return ApiError(400, piece.error or "invalid request", "invalid_value", piece.error_param)
    return ApiError(500, piece.error or "the engine failed", "engine_error")


def ended_error(piece: Piece) -> ApiError:
    """The client's error for a request that ended without its result: the engine's failure,
    or a cancel (the cancel route, a drain's deadline)."""
    if piece.finish_reason == FINISH_ABORT:
        # NOTE: the SDKs retry a 5xx unless told not to: a cancel is not to be resent
        return ApiError(500, "the request was cancelled before it finished", "cancelled",
                        headers={"x-should-retry": "false"})
    return piece_error(piece)


class Generation:
    """Runs one Job on the engine; iterate it once. Closing it (or `aclose`) aborts the request."""

    def __init__(
        self,
        client: EngineClientLike,
        tokenizer: Decoder,
        job: Job,
        metrics: Metrics,
        tick: float | None = None,
    ) -> None:
        self.job = job
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine found in its prefix cache
        self.finish_reason: str | None = None  # set once every choice has finished
        self._client = client
        self._metrics = metrics
        self._tick = tick
        s = job.sampling
        self._texts = [ChoiceText(tokenizer, s.skip_special_tokens, s.stop,
                                  s.include_stop_str_in_output) for _ in range(s.num_choices)]
        self.choice_finish_reasons: list[str | None] = [None] * s.num_choices
        # with sampling.prompt_logprobs: prompt tokens 1 .. P-1 (from choice 0's first delta)
        self.prompt_logprobs: list[PositionLogprobs] | None = None
        self._stream = client.submit(
            AddRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_ids,
                sampling=s,
                priority=job.priority,
                arrival_time=job.arrival,
                cache_salt=job.cache_salt,
                lora_name=job.lora_name,
            )
        )
        # the timeline (time.time()): scheduled is the engine's, the rest the gateway's
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.engine_metrics: RequestMetrics | None = None  # None if the gateway ended it
        self.error_param: str | None = None  # the field at fault, when the engine refused it
        self._last: float | None = None
        self._logged = False
        self._closed = False
        metrics.prompt_tokens.inc(len(job.prompt_ids))

    @property
    def closed(self) -> bool:
        """True once `aclose` ran (the request is aborted if unfinished, and counted)."""
        return self._closed

    def stop_string(self, index: int = 0) -> str | None:
        """The stop string that ended choice `index`, if one did."""
        return self._texts[index].matched

    @property
    def usage(self) -> dict[str, int]:
        prompt = len(self.job.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }

    async def __aiter__(self) -> AsyncIterator[Piece | None]:
        deltas = aiter(self._stream)
        pending: asyncio.Future[TokenDelta] | None = None
        try:
            while self.finish_reason is None:
                if pending is None:
                    pending = asyncio.ensure_future(anext(deltas))
                done, _ = await asyncio.wait({pending}, timeout=self._tick)
                if not done:
                    yield None
                    continue
                try:
                    delta = pending.result()
                except StopAsyncIteration:
                    delta = TokenDelta(
                        request_id=self.job.request_id, finish_reason=FINISH_ERROR,
                        error="the engine stream ended without a final output",
                    )
                pending = None
                piece = self._on_delta(delta)
                if piece is not None:
                    yield piece
        finally:
            if pending is not None:
                pending.cancel()
            await self.aclose()

    async def aclose(self) -> None:
        """Abort the engine request if it still runs; log and count the request once."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self._end_choices(FINISH_ABORT)
        await self._stream.aclose()
        self._finish_metrics()

    def _on_delta(self, delta: TokenDelta) -> Piece | None:
        now = time.monotonic()
        ids = delta.new_token_ids
        i = delta.index
        if delta.finish_reason == FINISH_ERROR:
            self.error_param = delta.error_param
            self._end_choices(FINISH_ERROR)
            return Piece("", ids, None, FINISH_ERROR, delta.error, index=i,
                         error_param=delta.error_param)
        if not 0 <= i < len(self._texts) or self.choice_finish_reasons[i] is not None:
            return None  # NOTE: a choice that a stop string ended here; its abort is on the way
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.scheduled_time is not None:
            self.scheduled_time = delta.scheduled_time
            self._metrics.queue_time.observe(max(0.0, delta.scheduled_time - self.job.arrival),
                                            self.job.model)
        if delta.metrics is not None:
            self.engine_metrics = delta.metrics
        if ids:
            self._count_tokens(now, len(ids))
        safe, stopped = self._texts[i].add(ids, delta.finished, delta.stop_reason is not None)
        lp, total = delta.logprobs, delta.cumulative_logprob
        if stopped:
            # NOTE: a stop string is a normal finish for the client; the engine is aborted.
            if not delta.finished:
                self._abort_choice(i)
            self._end_choice(i, FINISH_STOP)
            return Piece(safe, ids, lp, FINISH_STOP, index=i, cumulative_logprob=total,
                         forced=delta.forced_closing)
        if delta.finished:
            self._end_choice(i, delta.finish_reason)
            return Piece(safe, ids, lp, delta.finish_reason, delta.error, index=i,
                         cumulative_logprob=total, error_param=delta.error_param,
                         pooled=delta.pooled, forced=delta.forced_closing)
        if safe or ids:
            return Piece(safe, ids, lp, index=i, cumulative_logprob=total,
                         forced=delta.forced_closing)
        return None

    def _abort_choice(self, index: int) -> None:
        others = [r for j, r in enumerate(self.choice_finish_reasons) if j != index]
        if all(r is not None for r in others):
            self._client.abort(self.job.request_id)
        else:
            self._client.abort_choice(self.job.request_id, index)

    def _end_choice(self, index: int, reason: str | None) -> None:
        self.choice_finish_reasons[index] = reason or FINISH_ABORT
        reasons = self.choice_finish_reasons
        if all(r is not None for r in reasons):
            # NOTE: the request's one reason (metrics, WS done): abort if any choice was
            # aborted, else the first choice's
            self.finish_reason = FINISH_ABORT if FINISH_ABORT in reasons else reasons[0]
            self.finished_time = time.time()

    def _end_choices(self, reason: str) -> None:
        self.choice_finish_reasons = [r or reason for r in self.choice_finish_reasons]
        self.finish_reason = reason
        self.finished_time = time.time()

    def _count_tokens(self, now: float, n: int) -> None:
        m = self._metrics
        if self.first_token_time is None:
            self.first_token_time = time.time()
            m.ttft.observe(self.first_token_time - self.job.arrival, self.job.model)
        elif self._last is not None:
            m.itl.observe((now - self._last) / n, self.job.model)
        self._last = now
        self.completion_tokens += n
        m.generation_tokens.inc(n)

    def _finish_metrics(self) -> None:
        if self._logged:
            return
        self._logged = True
        if self.finished_time is None:  # aborted: the client left or the gateway closed it
            self.finished_time = time.time()
        e2e = self.finished_time - self.job.arrival
        reason = self.finish_reason or FINISH_ABORT
        if reason == FINISH_ERROR and self.error_param is not None:
            reason = FINISH_INVALID
        self._metrics.e2e.observe(e2e, self.job.model)
        self._metrics.finished(reason, self.job.model)
        fields: dict[str, Any] = dict(
            request_id=self.job.request_id, kind=self.job.kind, model=self.job.model,
            finish_reason=reason, e2e_s=round(e2e, 4),
            **self.usage,
        )
        if self.first_token_time is not None:  # the same TTFT as the histogram and timeline
            fields["ttft_s"] = round(self.first_token_time - self.job.arrival, 4)
        log.info("request.finished", **fields)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """The pieces of several generations (a request's prompts) as they come: (which, piece).
    Keep-alive ticks (None pieces) pass through for one generation only."""
    if len(gens) == 1:
        async for piece in gens[0]:
            yield 0, piece
        return
    iters = [aiter(g) for g in gens]
    pending = {asyncio.ensure_future(anext(it)): k for k, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f]):
                k = pending.pop(future)
                try:
                    piece = future.result()
                except StopAsyncIteration:
                    continue
                if piece is not None:
                    yield k, piece
                pending[asyncio.ensure_future(anext(iters[k]))] = k
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            await it.aclose()  # type: ignore[attr-defined]
