"""Deadlines for reading a request's head and body, and a bound on the head's size, on
uvicorn's httptools protocol (uvicorn's own keep-alive timer stops at a request's first
byte, so a client that sends half a request would hold the connection forever)."""

from __future__ import annotations

import asyncio

# NOTE: httptools, not h11: the gateway writes one chunk per token per stream, and h11's
# pure-Python state machine was about a quarter of the gateway's CPU at 64 streams; on 2
# cores every millisecond the gateway takes holds up both engine threads (the one it
# displaces, and the other at its next barrier).
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY_GRACE_S = 1.0  # NOTE: lets read_body's 408 go out before the connection is cut
MAX_HEAD_BYTES = 16 * 1024  # NOTE: h11's bound, which uvicorn's h11 protocol had


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """Closes a connection whose request head is not in `header_timeout` seconds after it
    opened (or after the last response, on keep-alive), or whose body is not in
    `body_timeout` seconds after its head (gateway.body.read_body answers 408 first; this also
    covers bodies no handler reads: a 401, a 404, a 413). A head over MAX_HEAD_BYTES gets a
    400 (httptools itself has no bound), counted up to the blank line that ends it, so a body
    sharing the read is not counted; pipelined heads behind a running request are counted
    from the end of the request before them."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    _phase: tuple[str, object] | None = None  # ("head" | "body", the cycle it is for)
    _timer: asyncio.TimerHandle | None = None
    _upgraded: bool = False
    _in_head: bool = True  # the bytes now arriving belong to a request head
    _head_bytes: int = 0  # of the head now arriving
    _tail: bytes = b""  # its last bytes (its closing blank line may span two reads)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._head_too_large(data):
            self._set_phase(None)
            if self.cycle is not None and not self.cycle.response_complete:
                self.transport.close()  # NOTE: no 400 into the middle of a running response
            else:
                self.send_400_response("Request head too large.")
            return
        super().data_received(data)
        self._track()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # a next head may follow

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True  # NOTE: the connection is the WebSocket protocol's now
        self._set_phase(None)
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _head_too_large(self, data: bytes) -> bool:
        start = 0
        if not self._tail:  # NOTE: the head has not begun: llhttp skips CR/LF before it
            start = len(data) - len(data.lstrip(b"\r\n"))
        seen = self._tail + data[start:]
        end = seen.find(b"\r\n\r\n")
        self._head_bytes += len(data) if end < 0 else start + end + 4 - len(self._tail)
        self._tail = seen[-3:]
        return self._head_bytes > MAX_HEAD_BYTES

    def _track(self) -> None:
        """The deadline for what the connection waits on now: the body of the request being
        read, the next request's head once every response is out, or nothing."""
        cycle = self.cycle
        if self._upgraded or self.transport.is_closing():
            self._set_phase(None)
        elif cycle is not None and cycle.more_body:
            self._set_phase(("body", cycle))  # NOTE: also after an early 413 / 401 / 404
        elif (cycle is None or cycle.response_complete) and not self.pipeline:
            self._set_phase(("head", cycle))
        else:  # NOTE: the request is in; its response (or a pipelined one) is running
            self._set_phase(None)

    def _set_phase(self, phase: tuple[str, object] | None) -> None:
        if phase == self._phase:
            return  # NOTE: a deadline runs from the start of its phase, not from the last byte
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if phase is not None:
            delay = (self.header_timeout if phase[0] == "head"
                     else self.body_timeout + _BODY_GRACE_S)
            self._timer = self.loop.call_later(delay, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            what = self._phase[0] if self._phase else "request"
            self.logger.info("closing a connection: request %s not read in time", what)
            self.transport.close()


def timed_protocol(header_timeout: float, body_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines."""
    return type("TimedHttpToolsProtocol", (TimedHttpToolsProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
