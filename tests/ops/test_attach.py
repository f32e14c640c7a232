"""The systemd topology without systemd: an engine started on its own (as pagedserve-engine@
runs it) and `serve --attach-engine`. The gateway stays up, answering 503, while the engine
is killed and started again; both speak sd_notify."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ops_support import NotifySocket, Server
from tiny_server import ROOT, tiny_model_dir

from ipc import exit_codes

pytestmark = pytest.mark.timeout(150)
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def start_engine(addrs: tuple[str, str], notify: NotifySocket, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "engine", "--model", str(tiny_model_dir()),
            "--served-model-name", "tiny-llama", "--max-model-len", "4096",
            "--num-gpu-blocks", "256", "--num-threads", "1", "--heartbeat-interval", "0.5",
            "--input-addr", addrs[0], "--output-addr", addrs[1]]
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    with log.open("ab") as err:
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)


def wait_health(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (got := httpx.get(f"{url}/health", timeout=5).status_code) != status:
        assert time.monotonic() < deadline, f"/health stayed {got}"
        time.sleep(0.1)


def test_gateway_survives_an_external_engine_restart(tmp_path: Path) -> None:
    addrs = (f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
    gw_notify, engine_notify = (NotifySocket(tmp_path / n) for n in ("gw.sock", "engine.sock"))
    server = Server(tmp_path, "--attach-engine", "--engine-input-addr", addrs[0],
                    "--engine-output-addr", addrs[1], "--engine-heartbeat-timeout", "3",
                    env={"NOTIFY_SOCKET": str(gw_notify.path)})
    engines: list[subprocess.Popen] = []
    try:
        gw_notify.wait_for("STATUS", "waiting for the engine", timeout=60)
        wait_health(server.url, 503, 30)
        assert "READY" not in gw_notify.keys()  # NOTE: not ready without an engine

        engines.append(start_engine(addrs, engine_notify, tmp_path / "engine.log"))
        engine_notify.wait_for("READY", "1", timeout=120)
        gw_notify.wait_for("READY", "1", timeout=30)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/v1/chat/completions", json=BODY,
                          timeout=30).status_code == 200
        engine_notify.wait_for("WATCHDOG", "1", timeout=5)

        engines[0].send_signal(signal.SIGKILL)
        engines[0].wait()
        wait_health(server.url, 503, 10)  # NOTE: the heartbeat lapse (3 s) is the only sign
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert httpx.get(f"{server.url}/livez").status_code == 200
        gw_notify.wait_for("STATUS", timeout=5)
        assert server.proc.poll() is None

        engines.append(start_engine(addrs, engine_notify, tmp_path / "engine.log"))
        wait_health(server.url, 200, 120)
        assert httpx.post(f"{server.url}/v1/chat/completions", json=BODY,
                          timeout=30).status_code == 200
        assert server.stop(timeout=20) == exit_codes.OK
        assert engines[1].poll() is None, "stopping the gateway leaves the engine unit alone"
        engines[1].send_signal(signal.SIGTERM)
        assert engines[1].wait(20) == exit_codes.OK
        assert "STOPPING" in engine_notify.keys()
    finally:
        for proc in engines:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.kill()
        gw_notify.close()
        engine_notify.close()
    statuses = [m["STATUS"] for m in gw_notify.messages if "STATUS" in m]
    assert any(s.startswith("engine unavailable") for s in statuses), statuses
