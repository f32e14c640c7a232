"""ASGI responses that notice a client going away: SSE streams and disconnect-raced JSON work.

Starlette cancels a streaming response on disconnect only for older ASGI servers and never a
plain handler, so both responses here listen for `http.disconnect` themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

PING = b": ping\n\n"  # an SSE comment: keeps a quiet stream open

T = TypeVar("T")


def json_response(payload: object, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), headers=headers, media_type="application/json")


async def prepend(first: list[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first` (items already read off `rest`, e.g. to see a grammar error), then the rest."""
    for item in first:
        yield item
    async for item in rest:
        yield item


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(work: Awaitable[object], receive: Receive) -> bool:
    """Run `work` until done or the client disconnects (then cancel it); True if it finished.

    A send to a closed connection (OSError) counts as a disconnect; other errors propagate.
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    if task.cancelled():
        return False
    error = task.exception()
    if isinstance(error, OSError):
        return False
    if error is not None:
        raise error
    return True


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of ready-made event bytes."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_disconnect: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self._on_disconnect = on_disconnect
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = await race_disconnect(self._stream(send), receive)
        if not finished:
            self._on_disconnect()
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _stream(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class DisconnectAwareResponse(Response):
    """Computes its response while watching for the client to leave (then `work` is cancelled)."""

    def __init__(self, work: Callable[[], Awaitable[Response]], on_disconnect: Callable[[], None]):
        self.status_code = 200
        self.background = None
        self._work = work
        self._on_disconnect = on_disconnect
        self.init_headers({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        result: list[Response] = []

        async def compute() -> None:
            result.append(await self._work())

        if await race_disconnect(compute(), receive):
            await result[0](scope, receive, send)
        else:
            self._on_disconnect()
