"""SIGTERM under load on a real `pagedserve serve` (tiny model): the shutdown checklist, sd_notify
messages along the way, the exit code, and no engine left behind."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import websockets
from ops_support import NotifySocket, Server

from ipc import exit_codes

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 3.0
PROMPT = [{"role": "user", "content": "Tell me a long story."}]


async def sse_events(http: httpx.AsyncClient, max_tokens: int,
                     started: asyncio.Event) -> tuple[list[str], float]:
    """A streaming chat request's `data:` payloads, and when the last one arrived."""
    body = {"messages": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    events: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events, time.monotonic()


def finish_reason(events: list[str]) -> str | None:
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return reasons[-1] if reasons else None


async def ws_frames(url: str, started: asyncio.Event) -> list[dict]:
    """One WS generation that outlives the deadline; frames until its terminal one."""
    request = {"messages": PROMPT, "max_tokens": 3500, "temperature": 0}
    frames: list[dict] = []
    async with websockets.connect(url, subprotocols=["pagedserve.v1"]) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "request": request}))
        while not frames or frames[-1]["type"] not in ("generation.done", "error"):
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            if frames[-1]["type"] == "generation.delta":
                started.set()
    return frames


async def test_sigterm_drains_under_load(tmp_path: Path, notify_socket: NotifySocket) -> None:
    server = Server(tmp_path, "--shutdown-timeout", str(DEADLINE_S), env={
        "NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000"})
    try:
        await asyncio.to_thread(notify_socket.wait_for, "READY", "1", 120)
        server.engine_pids.add(server.engine_pid())
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            # READY=1 is sent only once the engine hand-shook: the gateway is ready by then.
            assert (await http.get("/health")).status_code == 200
            assert notify_socket.messages[0] == {"STATUS": "starting the engine"}

            flags = [asyncio.Event() for _ in range(4)]
            long = [asyncio.create_task(sse_events(http, 3500, flags[i])) for i in range(2)]
            ws = asyncio.create_task(ws_frames(server.ws_url, flags[2]))
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags[:3])), 30)
            short = asyncio.create_task(sse_events(http, 40, flags[3]))
            await asyncio.wait_for(flags[3].wait(), 30)

            t0 = time.monotonic()
            server.proc.send_signal(15)
            await _until_status(http, "/health", 503, within=1.0)
            refused = await http.post("/v1/chat/completions",
                                      json={"messages": PROMPT, "max_tokens": 4})
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "server_draining"

            short_events, _ = await asyncio.wait_for(short, 30)
            assert finish_reason(short_events) == "length"  # in-flight work finishes
            for task in long:
                events, ended = await asyncio.wait_for(task, 30)
                assert events[-1] == "[DONE]" and finish_reason(events) == "abort"
                assert DEADLINE_S - 0.5 < ended - t0 < DEADLINE_S + 3
            frames = await asyncio.wait_for(ws, 30)
            types = [f["type"] for f in frames]
            assert "session.draining" in types
            assert frames[-1]["type"] == "generation.done" and frames[-1]["status"] == "cancelled"
        code = await asyncio.to_thread(server.proc.wait, 30)
        assert time.monotonic() - t0 < DEADLINE_S + 5, "exit within the deadline + a few s"
        assert code == exit_codes.DRAIN_TIMEOUT, server.log()
    finally:
        server.stop()  # NOTE: asserts every engine it had is gone
    keys = notify_socket.keys()
    assert "STOPPING" in keys and keys.count("WATCHDOG") >= 2
    statuses = [m["STATUS"] for m in notify_socket.messages if "STATUS" in m]
    assert any(s.startswith("draining") for s in statuses), statuses


async def _until_status(http: httpx.AsyncClient, path: str, status: int, within: float) -> None:
    deadline = time.monotonic() + within
    while (got := (await http.get(path)).status_code) != status:
        assert time.monotonic() < deadline, f"{path} still {got}"
        await asyncio.sleep(0.02)


def test_startup_failures_exit_2_or_5(tmp_path: Path) -> None:
    bad = Server(tmp_path, "--max-num-seqs", "0")
    assert bad.proc.wait(30) == exit_codes.CONFIG_ERROR
    assert "max_num_seqs must be >= 1" in bad.log()
    bad = Server(tmp_path, "--attach-engine")
    assert bad.proc.wait(30) == exit_codes.CONFIG_ERROR
    assert "--attach-engine needs" in bad.log()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = Server(tmp_path, port=taken.getsockname()[1])
        assert busy.proc.wait(60) == exit_codes.LISTEN_FAILED, busy.log()
    busy.stop()  # NOTE: checks that no engine it started is left
