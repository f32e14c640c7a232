"""`pagedserve serve` on the bundled model as a real subprocess on 127.0.0.1, shared by the
e2e tests: a free port, waiting for /health, and a server that is stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == want:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"/health never answered {want}")


@contextlib.contextmanager
def bundled_server(*flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(base URL, process) of `pagedserve serve` with `flags`, ready; stopped on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
         "--shutdown-timeout", "5", *flags],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, 200, 180)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
