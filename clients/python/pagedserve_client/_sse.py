"""A small pure Server-Sent Events parser: feed it bytes split anywhere, get whole events out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental parser (WHATWG event-stream rules): lines end in CRLF, LF or CR; `:` lines are
    comments; a blank line dispatches the event; an unfinished event at the end is dropped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        self._buf += chunk
        events = []
        while (line := self._next_line()) is not None:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _next_line(self) -> str | None:
        buf = self._buf
        cr, lf = buf.find(b"\r"), buf.find(b"\n")
        if cr == -1 and lf == -1:
            return None
        if cr != -1 and (lf == -1 or cr < lf):
            if cr == len(buf) - 1:
                return None  # NOTE: a CR at the end may be the first half of a CRLF
            end, skip = cr, 2 if buf[cr + 1:cr + 2] == b"\n" else 1
        else:
            end, skip = lf, 1
        # NOTE: whole lines are decoded, so a character split across chunks arrives intact.
        line = buf[:end].decode("utf-8", "replace")
        self._buf = buf[end + skip:]
        return line

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data and self._event is None:
            return None
        event = ServerSentEvent("\n".join(self._data), self._event, self._id, self._retry)
        self._data, self._event, self._retry = [], None, None
        return event
