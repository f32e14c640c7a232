"""One request's path through the gateway: submit, detokenize, match stop strings, count, abort.

Both the HTTP handlers and the WebSocket session consume a `Generation` as an async iterator of
`Piece`s (None while nothing arrived for `tick` seconds, so SSE can send `: ping`).
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
    PositionLogprobs,
    RequestMetrics,
    TokenDelta,
)
from ipc.sampling import SamplingParams
from ipc.text import IncrementalDetokenizer, StopMatcher

log = structlog.get_logger("pagedserve.request")


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

    def submit(self, msg: AddRequest) -> RequestStreamLike: ...

    def abort(self, request_id: str) -> None: ...


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    include_usage: bool = False
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    arrival: float = field(default_factory=time.time)
    trace_headers: dict[str, str] = field(default_factory=dict)  # traceparent of the caller
    created: int = field(default_factory=lambda: int(time.time()))
    tool_parser: Callable[[], Any] | None = None  # splits replies into content and tool calls


@dataclass
class Piece:
    """New text (stop strings held back) and the tokens behind it; `finish_reason` set is last."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault (a grammar that failed)


def piece_error(piece: Piece) -> ApiError:
    """The client's error for a piece that ended in FINISH_ERROR: 400 naming the field when
    the request was at fault (a grammar the engine refused), else 500."""
    if piece.error_param is not None:
        return ApiError(400, piece.error or "invalid request", "invalid_value", piece.error_param)
    return ApiError(500, piece.error or "the engine failed", "engine_error")


class Generation:
    """Runs one Job on the engine; iterate it once. Closing it (or `aclose`) aborts the request."""

    def __init__(
        self,
        client: EngineClientLike,
        tokenizer: Decoder,
        job: Job,
        metrics: Metrics,
        tick: float = 1.0,
    ) -> None:
        self.job = job
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine found in its prefix cache
        self.finish_reason: str | None = None
        self._client = client
        self._metrics = metrics
        self._tick = tick
        sampling = job.sampling
        self._detok = IncrementalDetokenizer(tokenizer, sampling.skip_special_tokens)
        self._stops = StopMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self._stream = client.submit(
            AddRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_ids,
                sampling=sampling,
                priority=job.priority,
                arrival_time=job.arrival,
                cache_salt=job.cache_salt,
            )
        )
        # the timeline (time.time()): scheduled is the engine's, the rest the gateway's
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.engine_metrics: RequestMetrics | None = None  # None if the gateway ended it
        self._last: float | None = None
        self._logged = False
        self._closed = False
        metrics.prompt_tokens.inc(len(job.prompt_ids))

    @property
    def started(self) -> bool:
        """True once the engine has answered (the request left its queue)."""
        return self.first_token_time is not None

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
            self.finish_reason = FINISH_ABORT
        await self._stream.aclose()
        self._finish_metrics()

    def _on_delta(self, delta: TokenDelta) -> Piece | None:
        now = time.monotonic()
        ids = delta.new_token_ids
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        if delta.scheduled_time is not None:
            self.scheduled_time = delta.scheduled_time
            self._metrics.queue_time.observe(max(0.0, delta.scheduled_time - self.job.arrival))
        if delta.metrics is not None:
            self.engine_metrics = delta.metrics
        if ids:
            self._count_tokens(now, len(ids))
        text = self._detok.add(ids)
        if delta.finished:
            text += self._detok.flush()
        safe, stopped = self._stops.push(text)
        if stopped:
            # NOTE: a stop string is a normal finish for the client; the engine is aborted.
            self.finish_reason = FINISH_STOP
            self.finished_time = time.time()
            self._client.abort(self.job.request_id)
            return Piece(safe, ids, delta.logprobs, FINISH_STOP)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.finished_time = time.time()
            safe += self._stops.flush()
            return Piece(safe, ids, delta.logprobs, delta.finish_reason, delta.error,
                         delta.error_param)
        if safe or ids:
            return Piece(safe, ids, delta.logprobs)
        return None

    def _count_tokens(self, now: float, n: int) -> None:
        m = self._metrics
        if self.first_token_time is None:
            self.first_token_time = time.time()
            m.ttft.observe(self.first_token_time - self.job.arrival)
        elif self._last is not None:
            m.itl.observe((now - self._last) / n)
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
        self._metrics.e2e.observe(e2e)
        self._metrics.requests.labels(finish_reason=reason).inc()
        fields: dict[str, Any] = dict(
            request_id=self.job.request_id, kind=self.job.kind, model=self.job.model,
            finish_reason=reason, e2e_s=round(e2e, 4),
            **self.usage,
        )
        if self.first_token_time is not None:  # the same TTFT as the histogram and timeline
            fields["ttft_s"] = round(self.first_token_time - self.job.arrival, 4)
        log.info("request.finished", **fields)
