"""Ops test helpers: a fake systemd notify socket, process checks, a stream's event gaps."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket, read by a thread (an unread one
    fills up after about ten messages); collects each message's fields."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def poll(self) -> list[dict[str, str]]:
        return list(self.messages)

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            messages = self.poll()
            for msg in messages[seen:]:
                if key in msg and (value is None or msg[key] == value):
                    return msg
            seen = len(messages)
            time.sleep(0.02)
        raise TimeoutError(f"no {key}={value} in {self.messages}")

    def keys(self) -> list[str]:
        return [key for msg in self.poll() for key in msg]

    def close(self) -> None:
        self._stop.set()
        self._reader.join()
        self._sock.close()


class Server:
    """`pagedserve serve` on the tiny model (tests/clients/tiny_server.py) as a subprocess whose
    exit code, children and stderr the test can inspect."""

    def __init__(self, log_dir: Path, *extra: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        from tiny_server import ROOT, free_port, serve_argv

        port = port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/v1/ws"
        self.log_path = log_dir / f"serve-{port}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                serve_argv(port, "--log-level", "info", *extra), cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.engine_pids: set[int] = set()  # every engine seen, for the orphan check

    def wait_ready(self, timeout: float = 120) -> None:
        from tiny_server import wait_ready

        wait_ready(self.url, self.proc, timeout)
        self.engine_pids.add(self.engine_pid())

    def engine_pid(self) -> int:
        pids = children(self.proc.pid)
        assert len(pids) == 1, pids
        return pids[0]

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, wait, and check that no engine this server ever had is left; the code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reap_engines()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reap_engines()

    def _reap_engines(self) -> None:
        # NOTE: spawned engines carry --parent-pid: that finds those never seen by the test.
        pids = self.engine_pids | set(spawned_engines(self.proc.pid))
        left = [pid for pid in pids if wait_gone(pid, 5.0) is False]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"orphan engine processes {left}\n{self.log()}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    return [int(p) for p, pp in (line.split() for line in out.splitlines()) if int(pp) == pid]


def spawned_engines(gateway_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    flag = re.compile(rf"-m engine .*--parent-pid {gateway_pid}(\s|$)")
    return [int(line.split(None, 1)[0]) for line in out.splitlines() if flag.search(line)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # NOTE: a zombie has exited; only its parent's wait is missing.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def rss_bytes(pid: int) -> int:
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


async def wait_engine_idle(url: str, timeout: float = 5.0) -> None:
    """Engine stats arrive with outputs or the ~1 s heartbeat: poll until nothing is held."""
    from tiny_server import metric

    deadline = time.monotonic() + timeout
    while True:
        total, free = (metric(url, f"pagedserve_kv_blocks_{k}") for k in ("total", "free"))
        held = (metric(url, "pagedserve_requests_running"),
                metric(url, "pagedserve_requests_waiting"), total - free)
        if held == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"running, waiting, KV blocks held: {held}"
        await asyncio.sleep(0.1)


async def record_gaps(client: httpx.AsyncClient, body: dict, gaps: list[float],
                      started: asyncio.Event, after: int = 5) -> None:
    """Stream a chat `body`, appending the seconds between its data events to `gaps`;
    `started` is set once `after` gaps are in (the stream is then known to be flowing)."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) == after:
                started.set()
