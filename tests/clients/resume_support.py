"""Helpers for the resumable-stream tests: SSE reads with httpx, metric reads, waits."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from tiny_server import MODEL_NAME

GRACE = 4.0  # the test server's --stream-grace-period


def chat_body(max_tokens: int, **extra: object) -> dict[str, object]:
    # NOTE: greedy and ignore_eos: a run is reproducible and as long as asked
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


@dataclass
class Events:
    """What a client saw of one SSE response: (id, data) per event."""

    events: list[tuple[str | None, str]] = field(default_factory=list)

    def add_lines(self, lines: list[str]) -> None:
        event_id, data = None, []
        for line in lines:
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            self.events.append((event_id, "\n".join(data)))

    @property
    def last_id(self) -> str:
        return [i for i, _ in self.events if i is not None][-1]

    @property
    def text(self) -> str:
        out = []
        for _, data in self.events:
            if data == "[DONE]":
                continue
            payload = json.loads(data)
            for choice in payload.get("choices") or []:
                out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
        return "".join(out)

    @property
    def done(self) -> int:
        return sum(1 for _, d in self.events if d == "[DONE]")


def read_sse(response: httpx.Response | Iterator[str], into: Events,
             stop_after: int | None = None) -> None:
    """Read events into `into`; with `stop_after`, return after that many (the caller then
    leaves the stream context, which drops the connection mid-stream). Pass the same
    `iter_lines()` to read one response in several parts."""
    lines: list[str] = []
    seen = 0
    source = response.iter_lines() if isinstance(response, httpx.Response) else response
    for line in source:
        if line:
            lines.append(line)
            continue
        into.add_lines(lines)
        lines = []
        seen += 1
        if stop_after is not None and seen >= stop_after:
            return


def metrics_text(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def metric_value(text: str, name: str, labels: str | None = None) -> float:
    """A sample's value (`name{labels} value`), 0 when absent."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def finished_total(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^pagedserve_requests_total\{[^}]*\} (\S+)$",
                                            text, re.M))


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class CuttingProxy:
    """A TCP proxy to 127.0.0.1:`port` whose `cut(down_for)` drops every connection through it
    and refuses new ones for `down_for` seconds: the network going away under a client."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._live: list[socket.socket] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, down_for: float = 0.0) -> None:
        with self._lock:
            self._down_until = time.monotonic() + down_for
            live, self._live = self._live, []
            self.cuts += 1
        for sock in live:
            _close(sock)

    def close(self) -> None:
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._down_until:
                _close(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._live += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass  # NOTE: the other side was cut
    _close(src)
    _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # NOTE: already shut
    sock.close()
