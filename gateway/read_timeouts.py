"""Deadlines and a size bound for reading a request: its head (request line and headers) and
its body, on uvicorn's httptools protocol.

uvicorn's protocols have no header deadline (the keep-alive timer stops at the first byte), so
a client that sends half a request would hold the connection forever. This subclass closes a
connection whose head is not in `header_timeout` seconds after it opened (or after the last
response, on keep-alive), or whose body is not in `body_timeout` seconds after its head. The
body deadline here is the backstop: `gateway.app.read_body` answers 408 first (it adds a
second of grace), and this also covers bodies no handler reads (a 401, a 404). A head longer
than `MAX_HEAD_BYTES` gets a 400 and the connection is closed (httptools itself has no bound;
uvicorn's h11 protocol had the same 16 KiB one).

NOTE: httptools, not h11: the gateway writes one chunk per token per stream, and h11's
pure-Python state machine was about a quarter of the gateway's CPU at 64 streams; on 2 cores
every millisecond the gateway takes holds up both of the engine's threads (one waits at the
next barrier for the one the gateway displaced).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY_GRACE_S = 1.0  # NOTE: lets read_body's 408 go out before the connection is cut
MAX_HEAD_BYTES = 16 * 1024


class TimedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    _phase: str | None = None  # "head", "body" or None (nothing to read: no deadline)
    _timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # bytes of the current head received so far
    _tail = b""  # the last bytes of the head so far (a blank line may span two reads)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._set_phase("head")

    def data_received(self, data: bytes) -> None:
        if self._phase == "head" and self._head_too_large(data):
            self._set_phase(None)
            self.send_400_response("Request head too large.")
            return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Counts the bytes of `data` up to the end of the head (a blank line), the body
        that may share the read not included; true past MAX_HEAD_BYTES."""
        seen = self._tail + data
        ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := seen.find(sep)) >= 0]
        self._head_bytes += min(ends) - len(self._tail) if ends else len(data)
        self._tail = seen[-3:]
        return self._head_bytes > MAX_HEAD_BYTES

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._set_phase("body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._set_phase(None)  # NOTE: the whole request is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._set_phase("head")  # keep-alive: the next request's head

    def handle_websocket_upgrade(self) -> None:
        self._set_phase(None)  # NOTE: the connection is the WebSocket protocol's now
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _set_phase(self, phase: str | None) -> None:
        if phase == "head":
            self._head_bytes, self._tail = 0, b""
        if phase == self._phase:
            return  # NOTE: a deadline runs from the start of its phase, not from the last byte
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if phase is not None:
            delay = self.header_timeout if phase == "head" else self.body_timeout + _BODY_GRACE_S
            self._timer = self.loop.call_later(delay, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection: request %s not read in time", self._phase)
            self.transport.close()


def timed_protocol(header_timeout: float, body_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines."""
    return type("TimedHttpToolsProtocol", (TimedHttpToolsProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
