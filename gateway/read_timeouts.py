"""Deadlines for reading a request: its head (request line and headers) and its body.

uvicorn's h11 protocol has no header deadline (its keep-alive timer stops at the first byte),
so a client that sends half a request holds the connection forever. This subclass closes a
connection whose head is not in `header_timeout` seconds after it opened (or after the last
response, on keep-alive), or whose body is not in `body_timeout` seconds after its head. The
body deadline here is the backstop: `gateway.app.read_body` answers 408 first (it adds a
second of grace), and this also covers bodies no handler reads (a 401, a 404).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY_GRACE_S = 1.0  # NOTE: lets read_body's 408 go out before the connection is cut


class TimedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    _phase: str | None = None  # "head", "body" or None (nothing to read: no deadline)
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _track(self) -> None:
        state = self.conn.their_state
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            self._set_phase(None)  # NOTE: closed, or handed over to a WebSocket protocol
        elif state is h11.IDLE:
            self._set_phase("head")
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:  # NOTE: the whole request is in
            self._set_phase(None)

    def _set_phase(self, phase: str | None) -> None:
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


def timed_h11_protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
