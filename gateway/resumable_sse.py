"""Resumable SSE: any streaming route opts in through `resumable_sse`; `GET` and `DELETE
/v1/streams/{stream_id}` resume and cancel (docs/resume.md).

Each event carries `id: <stream id>:<seq>`; a reconnect with `Last-Event-ID` (or `?after=`)
gets the events after that seq, then the live tail, from the same generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError
from gateway.resumable import ResumableStream, StreamRegistry, owner_digest, parse_last_event_id
from gateway.streaming import EventStreamResponse

KIND = "sse"
PING = b": ping\n\n"
# NOTE: a route's keep-alives (SSE comments, Anthropic's `ping` event) are not buffered: each
# reader sends its own comment (see _read)
KEEPALIVES = (b":", b"event: ping\n")


def wants_resumable(field: bool | None, server_default: bool, stream: bool) -> bool:
    """The request's `resumable` field, else the server's `--resumable-streams`; a request
    that asks for it without `stream: true` is refused (400 naming the field)."""
    if field and not stream:
        raise ApiError(400, "`resumable` needs `stream: true`", "invalid_value", "resumable")
    return stream and (field if field is not None else server_default)


def owner_of(headers: Headers) -> bytes:
    """The key a request presented (Bearer token, else Anthropic's x-api-key)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return owner_digest(token.strip())
    return owner_digest(headers.get("x-api-key", "").strip() or None)


def openai_error_event(exc: ApiError) -> bytes:
    return b"data: " + msgspec.json.encode(exc.envelope()) + b"\n\n"


def resumable_sse(registry: StreamRegistry, events: AsyncIterator[bytes], headers: Headers,
                  cancel: Callable[[], None], on_disconnect: Callable[[], None],
                  response_headers: dict[str, str], tick: float | None,
                  error_event: Callable[[ApiError], bytes] = openai_error_event) -> Response:
    """A route's SSE `events` as a resumable stream: they are produced on their own task (a
    dropped connection no longer ends them) and this response is the stream's first reader.
    Each event gets an `id:` line before its own (`event:` and `data:` lines stay as they
    are); the stream ends when `events` does (its `[DONE]` or the route's terminal event).
    `cancel` aborts the generation (DELETE /v1/streams/{id}, and the cancel route);
    `error_event` writes a reader's error (fell behind its buffer) in the route's shape."""

    async def produce(stream: ResumableStream) -> None:
        try:
            async for event in events:
                if event.startswith(KEEPALIVES):
                    continue
                event = f"id: {stream.id}:{stream.next_seq}\n".encode() + event
                stream.append(event, len(event))
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    stream = registry.open(KIND, owner_of(headers), produce, cancel)
    stream.meta["headers"] = {**response_headers, "X-Stream-Id": stream.id}
    stream.meta["error_event"] = error_event
    return EventStreamResponse(_read(stream, -1, tick), on_disconnect, stream.meta["headers"])


async def _read(stream: ResumableStream, after: int, tick: float | None) -> AsyncIterator[bytes]:
    try:
        async for item in stream.follow(after, tick):
            yield PING if item is None else item[1]
    except ApiError as exc:  # NOTE: this reader fell behind what the buffer keeps
        yield stream.meta["error_event"](exc)


class StreamRoutes:
    """`GET /v1/streams/{stream_id}` (resume) and `DELETE` (cancel), for the stream's key."""

    def __init__(self, registry: StreamRegistry, tick: float | None,
                 on_disconnect: Callable[[], None]) -> None:
        self.registry = registry
        self.tick = tick
        self.on_disconnect = on_disconnect

    def _find(self, request: Request) -> ResumableStream:
        stream_id = request.path_params["stream_id"]
        return self.registry.find(stream_id, KIND, owner_of(request.headers))

    async def resume(self, request: Request) -> Response:
        try:
            stream = self._find(request)
            after = _after(request, stream.id)
            stream.check_after(after)
        except ApiError as exc:
            return exc.response()
        self.registry.resumed()
        return EventStreamResponse(_read(stream, after, self.tick), self.on_disconnect,
                                   stream.meta["headers"])

    async def cancel(self, request: Request) -> Response:
        try:
            stream = self._find(request)
        except ApiError as exc:
            return exc.response()
        running = not stream.done
        if running:
            stream.cancel()
        return JSONResponse({"id": stream.id, "object": "stream.cancelled",
                             "cancelled": running})


def _after(request: Request, stream_id: str) -> int:
    """The last seq the client has: `Last-Event-ID` (what EventSource sends), else `?after=`,
    else -1 (from the start)."""
    last = request.headers.get("last-event-id")
    if last is not None:
        return parse_last_event_id(last, stream_id)
    raw = request.query_params.get("after")
    if raw is None:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"after must be an integer seq, not `{raw[:40]}`", "invalid_value",
                       "after") from None
