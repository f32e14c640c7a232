"""A clean start and stop of a real server (the tiny model) logs no warning and no death: the
web stack's WebSocket implementation is the current one (uvicorn deprecates the legacy one),
and an engine the gateway stops on shutdown is logged as stopped, not as died."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from tiny_server import ROOT, free_port, serve_argv, wait_ready

pytestmark = pytest.mark.timeout(300)


def test_a_clean_start_and_stop_logs_no_warning_and_no_death(tmp_path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(serve_argv(port, "--log-level", "info"), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text
    assert "DeprecationWarning" not in text and "Warning" not in text, text
    assert "died" not in text and " stopped: " in text, text
