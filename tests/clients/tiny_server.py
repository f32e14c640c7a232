"""A real `pagedserve serve` on a tiny random-weight Llama, for SDK, conformance and browser tests.

`python tests/clients/tiny_server.py PORT` builds the model once (cached) and execs the server;
the pytest fixtures and the TypeScript test setup both start servers through it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# NOTE: bump the suffix when the model's shape changes; the cache lives across test runs.
CACHE = Path(tempfile.gettempdir()) / "pagedserve-test-tiny-llama-v2"
MODEL_NAME = "tiny-llama"


def tiny_model_dir() -> Path:
    """The tiny model's directory, built on first use (a rename makes it appear whole)."""
    if (CACHE / "config.json").is_file():
        return CACHE
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_llama import build_tiny_llama

    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=CACHE.parent))
    try:
        # NOTE: a long context lets browser and cancel tests stop a generation mid-way; untied
        # embeddings keep a random model from repeating one token (tied ones echo newlines).
        build_tiny_llama(tmp, tokenizer_dir(resolve_model(None)), max_position_embeddings=4096,
                         tie_word_embeddings=False)
        os.replace(tmp, CACHE)
    except OSError:
        if not (CACHE / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CACHE


def serve_argv(port: int, *extra: str) -> list[str]:
    # NOTE: a `--model` in `extra` replaces the tiny model (a repeated --model serves several)
    model = [] if "--model" in extra else ["--model", str(tiny_model_dir())]
    return [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), *model,
            "--served-model-name", MODEL_NAME, "--max-model-len", "4096",
            "--num-gpu-blocks", "1024", "--max-num-seqs", "16", "--num-threads", "1",
            "--shutdown-timeout", "2", "--log-level", "warning", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health never answered 200")


@contextmanager
def running_server(*extra: str) -> Iterator[str]:
    """A server on a free 127.0.0.1 port; yields its base URL and stops it on exit."""
    with running_process(*extra) as (url, _):
        yield url


@contextmanager
def running_process(*extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """running_server, with its process (a test may signal it: it is stopped on exit unless
    it has exited already)."""
    port = free_port()
    proc = subprocess.Popen(serve_argv(port, *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def wait_idle(url: str, timeout: float = 5.0) -> float:
    """Poll until no request is running; returns the last running count."""
    deadline = time.monotonic() + timeout
    running = metric(url, "pagedserve_requests_running")
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = metric(url, "pagedserve_requests_running")
    return running


if __name__ == "__main__":
    argv = serve_argv(int(sys.argv[1]), *sys.argv[2:])
    os.chdir(ROOT)
    os.execv(argv[0], argv)
