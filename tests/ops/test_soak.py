"""Soak: mixed load (SSE, JSON, disconnects, cancel calls, WebSocket with cancels) on a real
server for $PAGEDSERVE_SOAK_SECONDS (default 10; `make soak` runs 1800). At the end nothing is
held, every admitted request finished exactly once, and memory and descriptors stay flat.
Samples of RSS, descriptors and KV blocks in use over the run are printed, and written as JSON
to $PAGEDSERVE_SOAK_OUT when it is set."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
import uuid
from pathlib import Path

import httpx
import pytest
import websockets
from ops_support import Server, rss_bytes, wait_engine_idle

SECONDS = float(os.environ.get("PAGEDSERVE_SOAK_SECONDS", "10"))
CONCURRENCY = 8
pytestmark = pytest.mark.timeout(SECONDS + 150)
PROMPTS = ["Hi", "Tell me a story about a fox.", "List ten colours.", "Why is the sky blue?"]


def chat(rng: random.Random, request_id: str, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(1, 200), "stream": stream, "request_id": request_id,
            "temperature": rng.choice([0.0, 0.8])}


class Load:
    def __init__(self, server: Server, seed: int) -> None:
        self.server = server
        self.rng = random.Random(seed)
        self.sent: set[str] = set()  # request ids the server admitted (status 200)
        self.outcomes: collections.Counter[str] = collections.Counter()

    async def worker(self, http: httpx.AsyncClient, deadline: float) -> None:
        kinds = [self.sse, self.json, self.disconnect, self.cancel_call, self.websocket]
        while time.monotonic() < deadline:
            await self.rng.choice(kinds)(http)

    async def sse(self, http: httpx.AsyncClient, stop_after: int | None = None) -> None:
        rid = f"soak-{uuid.uuid4().hex}"
        async with http.stream("POST", "/v1/chat/completions",
                               json=chat(self.rng, rid, True)) as response:
            assert response.status_code == 200, await response.aread()
            self.sent.add(rid)
            n = 0
            async for line in response.aiter_lines():
                n += line.startswith("data: ")
                if stop_after is not None and n >= stop_after:
                    self.outcomes["disconnected"] += 1
                    return  # NOTE: leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    self.outcomes["sse"] += 1

    async def json(self, http: httpx.AsyncClient) -> None:
        rid = f"soak-{uuid.uuid4().hex}"
        response = await http.post("/v1/chat/completions", json=chat(self.rng, rid, False))
        assert response.status_code == 200, response.text
        self.sent.add(rid)
        self.outcomes["json:" + response.json()["choices"][0]["finish_reason"]] += 1

    async def disconnect(self, http: httpx.AsyncClient) -> None:
        await self.sse(http, stop_after=self.rng.randint(1, 5))

    async def cancel_call(self, http: httpx.AsyncClient) -> None:
        rid = f"soak-{uuid.uuid4().hex}"
        body = {**chat(self.rng, rid, False), "max_tokens": 300}
        task = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await asyncio.sleep(self.rng.uniform(0, 0.2))
        await http.post(f"/v1/requests/{rid}/cancel")  # NOTE: 404 when it already finished
        response = await task
        assert response.status_code == 200, response.text
        self.sent.add(rid)
        self.outcomes["cancel:" + response.json()["choices"][0]["finish_reason"]] += 1

    async def websocket(self, http: httpx.AsyncClient) -> None:
        ids = {f"g{i}": f"soak-{uuid.uuid4().hex}" for i in range(self.rng.randint(1, 4))}
        async with websockets.connect(self.server.ws_url, subprotocols=["pagedserve.v1"]) as ws:
            for gen_id, rid in ids.items():
                request = chat(self.rng, rid, False)
                await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": request}))
            done: set[str] = set()
            while done != set(ids):
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if frame["type"] == "generation.started":
                    self.sent.add(ids[frame["id"]])
                    if self.rng.random() < 0.3:
                        await ws.send(json.dumps({"type": "cancel", "id": frame["id"]}))
                elif frame["type"] in ("generation.done", "error"):
                    assert frame["type"] == "generation.done" or frame["error"]["code"] in (
                        "generation_not_found",), frame  # NOTE: a cancel that came too late
                    if frame["type"] == "generation.done":
                        done.add(frame["id"])
                        self.outcomes["ws:" + frame["status"]] += 1
                if self.rng.random() < 0.01:
                    self.outcomes["ws:closed"] += 1
                    return  # NOTE: closing the socket aborts what is left


def finished_ids(log: Path) -> collections.Counter[str]:
    ids: collections.Counter[str] = collections.Counter()
    for line in log.read_text(errors="replace").splitlines():
        if '"request.finished"' in line:
            ids[json.loads(line)["request_id"]] += 1
    return ids


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def sample(server: Server, engine: int, t0: float, period: float,
                 samples: list[dict[str, float]]) -> None:
    """Every `period` s: elapsed s, gateway and engine RSS (MiB), descriptors, blocks in use."""
    from tiny_server import metric

    while True:
        total, free, running = await asyncio.to_thread(
            lambda: [metric(server.url, f"pagedserve_{name}") for name in
                     ("kv_blocks_total", "kv_blocks_free", "requests_running")])
        samples.append({"t": round(time.monotonic() - t0, 1),
                        "gateway_rss_mib": round(rss_bytes(server.proc.pid) / 2**20, 1),
                        "engine_rss_mib": round(rss_bytes(engine) / 2**20, 1),
                        "gateway_fds": open_fds(server.proc.pid),
                        "kv_blocks_used": total - free, "running": running})
        await asyncio.sleep(period)


async def test_soak(tmp_path: Path) -> None:
    server = Server(tmp_path)
    try:
        server.wait_ready()
        engine = server.engine_pid()
        load = Load(server, seed=1)
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            warmup = time.monotonic() + min(5.0, SECONDS / 4)
            await asyncio.gather(*(load.worker(http, warmup) for _ in range(CONCURRENCY)))
            await wait_engine_idle(server.url)
            before = (rss_bytes(server.proc.pid), rss_bytes(engine), open_fds(server.proc.pid))
            t0 = time.monotonic()
            deadline = t0 + SECONDS
            samples: list[dict[str, float]] = []
            sampler = asyncio.create_task(sample(server, engine, t0, max(1.0, SECONDS / 30),
                                                 samples))
            await asyncio.gather(*(load.worker(http, deadline) for _ in range(CONCURRENCY)))
            sampler.cancel()
        await wait_engine_idle(server.url, timeout=10)
        after = (rss_bytes(server.proc.pid), rss_bytes(engine), open_fds(server.proc.pid))
        for s in samples:
            print("soak sample", json.dumps(s))
        print(f"soak {SECONDS:g}s: {len(load.sent)} requests {dict(load.outcomes)}; "
              f"gateway RSS {before[0] >> 20}->{after[0] >> 20} MiB, engine RSS "
              f"{before[1] >> 20}->{after[1] >> 20} MiB, gateway fds {before[2]}->{after[2]}")
        if os.environ.get("PAGEDSERVE_SOAK_OUT"):
            Path(os.environ["PAGEDSERVE_SOAK_OUT"]).write_text(json.dumps({
                "seconds": SECONDS, "requests": len(load.sent), "outcomes": load.outcomes,
                "before": before, "after": after, "samples": samples}, indent=1))
        assert samples, "the sampler never ran"
        assert server.engine_pid() == engine, "the engine never restarted"
        assert after[0] - before[0] < 48 << 20 and after[1] - before[1] < 96 << 20
        assert after[2] <= before[2] + 8
        finished = finished_ids(server.log_path)
        assert all(n == 1 for n in finished.values())
        assert load.sent <= set(finished), f"lost: {sorted(load.sent - set(finished))[:5]}"
    finally:
        server.stop()
