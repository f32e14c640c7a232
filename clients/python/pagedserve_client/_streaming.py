"""SSE responses as iterators of typed chunks; closing one drops the connection, which the
server turns into an abort of the request.

A resumable stream (the response named an `X-Stream-Id`) that breaks is reopened with
`GET /v1/streams/{id}` and `Last-Event-ID`: the server sends only the events after the last one
read, so the text continues exactly once; closing it early cancels it with `DELETE`. It has
ended at `[DONE]` (chat, completions) or at its terminal event (Responses, Messages, which send
no `[DONE]`); a body that ends before either is a break.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import msgspec

from pagedserve_client._errors import APIConnectionError, PagedServeError, stream_error
from pagedserve_client._retry import retry_delay
from pagedserve_client._sse import ServerSentEvent, SSEDecoder

T = TypeVar("T")
R = TypeVar("R")
MAX_RESUMES = 5  # reconnects in a row that bring no new event before the stream gives up
# the SSE `event:` names that end a stream which sends no [DONE] (Responses, Messages)
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed",
                             "message_stop", "error"})


def _decode(event: ServerSentEvent, cls: type[T], request_id: str | None) -> T:
    try:
        payload: Any = msgspec.json.decode(event.data)
    except msgspec.DecodeError as exc:
        raise APIConnectionError(f"invalid JSON in stream: {exc}", request_id=request_id) from None
    if event.event == "error" or (isinstance(payload, dict) and "error" in payload):
        raise stream_error(payload, request_id)
    return msgspec.convert(payload, cls)


@dataclass
class Resumer(Generic[R]):
    """How a resumable stream reopens (`reopen(last_event_id)`) and cancels itself."""

    stream_id: str
    reopen: Callable[[str | None], R]
    cancel: Callable[[], Any]


class _Reader:
    """The parsing state one stream keeps across its reconnects."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self.finished = False
        self.fruitless = 0  # reconnects since the last event

    def events(self, decoder: SSEDecoder, data: bytes) -> Iterator[ServerSentEvent]:
        for event in decoder.feed(data):
            if event.id is not None:
                self.last_event_id = event.id
            self.fruitless = 0
            if event.data == "[DONE]":
                self.finished = True
                return
            if event.event in TERMINAL_EVENTS:
                self.finished = True  # NOTE: before the yield: an `error` event raises there
                yield event
                return
            yield event

    def broke(self, resumer: Resumer[Any] | None, error: APIConnectionError | None,
              ) -> APIConnectionError | None:
        """The error to raise now (None: reconnect, or end quietly when error is None)."""
        if self.finished:
            return None
        if resumer is None or self.fruitless >= MAX_RESUMES:
            return error
        self.fruitless += 1
        return None


class Stream(Generic[T]):
    """Chunks of one streamed request. Use it in a `with` block (or call `close()`) so that
    leaving early cancels the generation on the server."""

    def __init__(self, response: httpx.Response, cls: type[T],
                 resumer: Resumer[httpx.Response] | None = None) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self.stream_id = resumer.stream_id if resumer is not None else None
        self.resumes = 0  # reconnects made
        self._cls = cls
        self._resumer = resumer
        self._reader = _Reader()
        self._iter = self._chunks()

    def __iter__(self) -> Iterator[T]:
        return self._iter

    def __next__(self) -> T:
        return next(self._iter)

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._iter.close()
        self.response.close()
        if self._resumer is not None and not self._reader.finished:
            _cancel_quietly(self._resumer.cancel)

    def _chunks(self) -> Iterator[T]:
        reader = self._reader
        while True:
            decoder, error = SSEDecoder(), None
            try:
                for data in self.response.iter_bytes():
                    for event in reader.events(decoder, data):
                        yield _decode(event, self._cls, self.request_id)
                    if reader.finished:
                        return
                if self._resumer is not None:  # NOTE: a plain stream ends quietly, as before
                    error = APIConnectionError("stream ended before its last event",
                                               request_id=self.request_id)
            except httpx.TransportError as exc:
                error = APIConnectionError(f"stream broke: {exc}", request_id=self.request_id)
                error.__cause__ = exc
            finally:
                self.response.close()
            if (raised := reader.broke(self._resumer, error)) is not None:
                raise raised
            if self._resumer is None:
                return
            while True:
                time.sleep(retry_delay(reader.fruitless - 1))
                try:
                    self.response = self._resumer.reopen(reader.last_event_id)
                    break
                except APIConnectionError as exc:  # NOTE: still cut off: try again, bounded
                    if (raised := reader.broke(self._resumer, exc)) is not None:
                        raise
            self.resumes += 1


class AsyncStream(Generic[T]):
    """The async twin of `Stream`: `async with` it, or `await stream.aclose()`."""

    def __init__(self, response: httpx.Response, cls: type[T],
                 resumer: Resumer[Awaitable[httpx.Response]] | None = None) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self.stream_id = resumer.stream_id if resumer is not None else None
        self.resumes = 0
        self._cls = cls
        self._resumer = resumer
        self._reader = _Reader()
        self._iter = self._chunks()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iter

    async def __anext__(self) -> T:
        return await self._iter.__anext__()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._iter.aclose()
        await self.response.aclose()
        if self._resumer is not None and not self._reader.finished:
            try:
                await self._resumer.cancel()
            except PagedServeError:
                pass  # NOTE: unreachable server: its grace period aborts the generation

    async def _chunks(self) -> AsyncIterator[T]:
        reader = self._reader
        while True:
            decoder, error = SSEDecoder(), None
            try:
                async for data in self.response.aiter_bytes():
                    for event in reader.events(decoder, data):
                        yield _decode(event, self._cls, self.request_id)
                    if reader.finished:
                        return
                if self._resumer is not None:  # NOTE: a plain stream ends quietly, as before
                    error = APIConnectionError("stream ended before its last event",
                                               request_id=self.request_id)
            except httpx.TransportError as exc:
                error = APIConnectionError(f"stream broke: {exc}", request_id=self.request_id)
                error.__cause__ = exc
            finally:
                await self.response.aclose()
            if (raised := reader.broke(self._resumer, error)) is not None:
                raise raised
            if self._resumer is None:
                return
            while True:
                await asyncio.sleep(retry_delay(reader.fruitless - 1))
                try:
                    self.response = await self._resumer.reopen(reader.last_event_id)
                    break
                except APIConnectionError as exc:
                    if (raised := reader.broke(self._resumer, exc)) is not None:
                        raise
            self.resumes += 1


def _cancel_quietly(cancel: Callable[[], Any]) -> None:
    try:
        cancel()
    except PagedServeError:
        pass  # NOTE: unreachable server: its grace period aborts the generation
