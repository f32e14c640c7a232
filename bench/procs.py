"""Servers the benchmarks start as child processes: wait for /health, stop with SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time


def wait_health(url: str, proc: subprocess.Popen, timeout: float, name: str = "server",
                poll_s: float = 0.3) -> None:
    """Return once GET {url}/health is 200; raise if `proc` exits first (with the tail of its
    stderr when that is a pipe) or after `timeout` seconds."""
    import httpx  # NOTE: here, so bench/gpu_check.py imports it only when it starts a server

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-600:] if proc.stderr else ""
            raise RuntimeError(f"{name} exited with {proc.returncode}{': ' + err if err else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{name}: /health was not 200 within {timeout:g} s")


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
