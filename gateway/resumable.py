"""Resumable streams: a generation's events in a bounded buffer that outlives its connection.

A stream's producer runs on its own task; each reader (a connection) replays the buffer after a
seq, then follows the live tail. No reader for the grace period: its generation is aborted and
the stream expires (docs/resume.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.errors import ApiError
from gateway.settings import StreamLimits

Emit = Callable[[Any, int], None]  # (event, its size in bytes)
MAX_TOMBSTONES = 4096  # expired ids remembered, so a late resume hears `stream_expired`


def owner_digest(token: str | None) -> bytes:
    """What a stream is bound to: a digest of the key (bearer token) that started it."""
    return hashlib.sha256((token or "").encode()).digest()


def expired_error(stream_id: str, why: str) -> ApiError:
    return ApiError(410, f"stream `{stream_id}` can no longer be resumed: {why}",
                    "stream_expired", "stream_id")


def not_found_error(stream_id: str) -> ApiError:
    return ApiError(404, f"no resumable stream `{stream_id}`", "stream_not_found", "stream_id")


class ResumableStream:
    """One generation's events, numbered from 0. The registry owns it; readers follow it."""

    def __init__(self, registry: StreamRegistry, stream_id: str, kind: str, owner: bytes,
                 cancel: Callable[[], None]) -> None:
        self.id = stream_id
        self.kind = kind  # "sse" or "ws": a stream resumes only on its own transport
        self.owner = owner
        self.meta: dict[str, Any] = {}  # what the transport needs on resume (request id, ...)
        self.next_seq = 0
        self.bytes = 0
        self.done = False  # the producer ended: no event follows
        self.expired = False
        self.readers = 0
        self._events: deque[tuple[int, float, int, Any]] = deque()  # seq, time, size, event
        self._changed = asyncio.Event()
        self._registry = registry
        self._cancel = cancel
        self._timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def first_seq(self) -> int:
        """The oldest seq still buffered (next_seq when none is)."""
        return self._events[0][0] if self._events else self.next_seq

    def append(self, event: Any, size: int) -> None:
        if self.expired:
            return  # NOTE: the aborted generation's last events: nobody can read them
        self._events.append((self.next_seq, time.monotonic(), size, event))
        self.next_seq += 1
        self.bytes += size
        self._registry.grew(self, size)
        self._wake()

    def cancel(self) -> None:
        """Abort the generation now; it still ends through its producer (readers get its
        last events), so the producer task itself is never cancelled."""
        self._cancel()

    def check_after(self, after: int, param: str = "after") -> None:
        """Raise `stream_expired` when events after `after` were dropped (bounds, age)."""
        self._registry.trim_age(self)
        if after + 1 < self.first_seq:
            raise expired_error(self.id, f"events after {after} were dropped from its buffer "
                                         "(size or age bound)")
        if not -1 <= after < self.next_seq:
            raise ApiError(400, f"seq {after} was never sent (the stream is at "
                                f"{self.next_seq - 1})", "invalid_value", param)

    async def follow(self, after: int, tick: float | None = None
                     ) -> AsyncIterator[tuple[int, Any] | None]:
        """(seq, event) for every event after `after`, then the live tail until the producer
        ends; None after `tick` idle seconds. The reader counts as attached until it closes."""
        self._attach()
        try:
            nxt = after + 1
            while True:
                changed = self._changed
                if nxt < self.first_seq:
                    raise expired_error(self.id, f"the reader fell behind past its buffer at "
                                                 f"seq {nxt}")
                for seq, _, _, event in list(self._events):
                    if seq >= nxt:
                        yield seq, event
                        nxt = seq + 1
                if nxt >= self.next_seq:
                    if self.done:
                        return
                    try:
                        await asyncio.wait_for(changed.wait(), tick)
                    except TimeoutError:
                        yield None
        finally:
            self._detach()

    # ---- the registry's side ------------------------------------------------------------

    def drop_oldest(self) -> int:
        _, _, size, _ = self._events.popleft()
        self.bytes -= size
        return size

    def oldest_time(self) -> float | None:
        return self._events[0][1] if self._events else None

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _attach(self) -> None:
        self.readers += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _detach(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self.start_grace()

    def start_grace(self) -> None:
        if self._timer is None and not self.expired:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._registry.limits.grace_period, self._grace_over)

    def _grace_over(self) -> None:
        self._timer = None
        if self.readers == 0:
            self._registry.expire(self)

    def finish(self) -> None:
        self.done = True
        self._wake()


class StreamRegistry:
    """Every resumable stream of the gateway, by id; enforces the byte and age bounds."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self.streams: dict[str, ResumableStream] = {}
        self._tombstones: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # -> kind, owner
        self.buffered_bytes = 0
        self.resumes = 0  # readers that attached after the first
        self.expired = 0  # streams removed after their grace period
        self.aborted = 0  # of those, generations still running (aborted by the expiry)
        self.events_dropped = 0

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def unread(self) -> int:
        return sum(1 for s in self.streams.values() if s.readers == 0)

    def open(self, kind: str, owner: bytes, produce: Callable[[ResumableStream], Awaitable[None]],
             cancel: Callable[[], None]) -> ResumableStream:
        """Start `produce(stream)` (which appends the events) on its own task; the grace
        timer runs until the first reader attaches. `cancel()` must make the producer end
        (abort its engine request), as an explicit cancel and the expiry call it."""
        stream = ResumableStream(self, secrets.token_urlsafe(18), kind, owner, cancel)
        self.streams[stream.id] = stream
        stream.task = asyncio.create_task(self._produce(stream, produce))
        stream.start_grace()
        return stream

    async def _produce(self, stream: ResumableStream,
                       produce: Callable[[ResumableStream], Awaitable[None]]) -> None:
        try:
            await produce(stream)
        finally:
            stream.finish()

    def find(self, stream_id: str, kind: str, owner: bytes) -> ResumableStream:
        """The stream to resume: 404 when unknown or bound to another key, 410 once expired."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.kind == kind and hmac.compare_digest(stream.owner,
                                                                               owner):
            return stream
        gone = self._tombstones.get(stream_id)
        if stream is None and gone is not None and gone[0] == kind and \
                hmac.compare_digest(gone[1], owner):
            raise expired_error(stream_id, "its grace period passed with no reader")
        raise not_found_error(stream_id)

    def resumed(self) -> None:
        self.resumes += 1

    def grew(self, stream: ResumableStream, size: int) -> None:
        self.buffered_bytes += size
        self.trim_age(stream)
        while stream.bytes > self.limits.max_stream_bytes:
            self._drop(stream)
        while self.buffered_bytes > self.limits.max_total_bytes:
            self._drop(max(self.streams.values(), key=lambda s: s.bytes))

    def trim_age(self, stream: ResumableStream) -> None:
        horizon = time.monotonic() - self.limits.max_event_age
        while (t := stream.oldest_time()) is not None and t < horizon:
            self._drop(stream)

    def _drop(self, stream: ResumableStream) -> None:
        self.buffered_bytes -= stream.drop_oldest()
        self.events_dropped += 1

    def expire(self, stream: ResumableStream) -> None:
        """The grace period passed with no reader: forget the stream, abort its generation."""
        stream.expired = True
        self.streams.pop(stream.id, None)
        self._tombstones[stream.id] = (stream.kind, stream.owner)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        while stream.oldest_time() is not None:
            self.buffered_bytes -= stream.drop_oldest()
        self.expired += 1
        if not stream.done:
            self.aborted += 1
            stream.cancel()


def parse_last_event_id(value: str, stream_id: str) -> int:
    """The seq of a `Last-Event-ID` (`<stream id>:<seq>`) of this stream; 400 otherwise."""
    sid, _, seq = value.strip().rpartition(":")
    if sid != stream_id or not seq.lstrip("-").isdigit():
        raise ApiError(400, f"Last-Event-ID `{value[:80]}` is not `{stream_id}:<seq>`",
                       "invalid_value", "Last-Event-ID")
    return int(seq)
