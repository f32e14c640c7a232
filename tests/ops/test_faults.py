"""Fault injection and load on a real `pagedserve serve` (tiny model, 127.0.0.1): kill -9 of the
engine under 10 streams, a hung engine, 200 clients that give up, and overload."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ops_support import Server, rss_bytes, wait_engine_idle, wait_gone
from tiny_server import metric

from ipc import exit_codes

pytestmark = pytest.mark.timeout(150)
PROMPT = [{"role": "user", "content": "Tell me a long story."}]
HEARTBEAT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("faults"),
                 "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    assert code == exit_codes.OK, "an idle SIGTERM is a clean exit"


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"messages": PROMPT, "max_tokens": max_tokens, "stream": stream, "temperature": 0}


async def stream_until_end(http: httpx.AsyncClient, max_tokens: int,
                           started: asyncio.Event) -> tuple[list[str], float]:
    events: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body(max_tokens, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events, time.monotonic()


async def wait_health(http: httpx.AsyncClient, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (await http.get("/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health never {status}"
        await asyncio.sleep(0.1)


async def test_kill_9_under_10_streams(server: Server) -> None:
    old = server.engine_pid()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        flags = [asyncio.Event() for _ in range(10)]
        streams = [asyncio.create_task(stream_until_end(http, 3000, f)) for f in flags]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        for events, ended in await asyncio.wait_for(asyncio.gather(*streams), 30):
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
            assert ended - t0 < HEARTBEAT_TIMEOUT_S
        refused = await http.post("/v1/chat/completions", json=body(4))
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "engine_unavailable"
        await wait_health(http, 200, 90)
        reply = await http.post("/v1/chat/completions", json=body(4))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert wait_gone(old, 5)
    server.engine_pids.add(server.engine_pid())
    await wait_engine_idle(server.url)


async def test_200_clients_give_up_then_one_succeeds(server: Server) -> None:
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
        prompt = (await http.post("/tokenize", json={"messages": PROMPT})).json()["count"]
        admitted = metric(server.url, "pagedserve_prompt_tokens_total")

        async def call(i: int) -> None:
            async with http.stream("POST", "/v1/chat/completions",
                                   json=body(2000, stream=i % 2 == 0)) as r:
                await r.aread()

        calls = [asyncio.ensure_future(call(i)) for i in range(200)]
        # NOTE: the clients give up once the gateway has admitted all 200 (its prompt-token
        # counter moved by 200 prompts), not after a fixed time: on a loaded machine a client
        # that gives up after half a second may leave before its request arrives.
        deadline = time.monotonic() + 120
        while (await asyncio.to_thread(metric, server.url, "pagedserve_prompt_tokens_total")
               < admitted + 200 * prompt):
            assert not any(c.done() for c in calls), "a 2000-token request finished"
            assert time.monotonic() < deadline, "the gateway did not admit the 200 requests"
            await asyncio.sleep(0.1)
        for c in calls:
            c.cancel()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
        reply = await http.post("/v1/chat/completions", json=body(8))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    await wait_engine_idle(server.url)
    # A loaded gateway may read some of the 200 only after they left: poll until all are counted.
    deadline = time.monotonic() + 30
    while (gone := metric(server.url, "pagedserve_client_disconnects_total")) < 200:
        assert time.monotonic() < deadline, f"{gone} of 200 disconnects counted"
        await asyncio.sleep(0.2)


async def _poll_metric(url: str, name: str, want: float, holders: list[asyncio.Task],
                       timeout: float = 60) -> None:
    """Poll a gauge (off the loop, which carries the requests) until it reads `want`, while
    the held streams still hold their seats."""
    deadline = time.monotonic() + timeout
    while (value := await asyncio.to_thread(metric, url, name)) != want:
        assert not any(h.done() for h in holders), f"a held stream ended with {name} {value}"
        assert time.monotonic() < deadline, f"{name} stayed {value}, not {want}"
        await asyncio.sleep(0.05)


async def _hold(http: httpx.AsyncClient) -> None:
    """A stream that runs to the context's end unless cancelled (it keeps one engine seat).
    NOTE: read as raw bytes, not parsed into lines: on a loaded machine the parsing of two
    floods of chunks starved the requests under test on this loop."""
    async with http.stream("POST", "/v1/chat/completions", json={
            **body(4000, True), "ignore_eos": True}) as r:
        assert r.status_code == 200
        async for _ in r.aiter_raw():
            pass


# NOTE: a backstop, not a threshold: three held rounds after a server start took over the
# module's 150 s once on two loaded cores
@pytest.mark.timeout(300)
async def test_overload_is_refused_and_memory_stays_bounded(tmp_path: Path) -> None:
    """The queue is filled before the burst, whatever the machine's speed: two held streams
    take both engine seats, four requests are seen waiting in the engine, then each of 40
    concurrent requests finds the queue full (503); released, the four complete."""
    server = Server(tmp_path, "--max-queued-requests", "4", "--max-num-seqs", "2")
    try:
        server.wait_ready()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            rss = []
            for _ in range(3):
                holders = [asyncio.create_task(_hold(http)) for _ in range(2)]
                await _poll_metric(server.url, "pagedserve_requests_running", 2, holders)
                queued = [asyncio.create_task(http.post("/v1/chat/completions", json=body(32)))
                          for _ in range(4)]
                await _poll_metric(server.url, "pagedserve_requests_waiting", 4, holders)
                replies = await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=body(32)) for _ in range(40)))
                statuses = [r.status_code for r in replies]
                assert not any(h.done() for h in holders), (
                    f"a held stream ended before the burst was answered: {statuses}")
                rss.append(rss_bytes(server.proc.pid))
                for h in holders:
                    h.cancel()
                done = await asyncio.gather(*queued)
                await asyncio.gather(*holders, return_exceptions=True)
                assert statuses == [503] * 40
                assert all(int(r.headers["retry-after"]) >= 1 for r in replies)
                assert {r.json()["error"]["code"] for r in replies} == {"server_overloaded"}
                assert [r.status_code for r in done] == [200] * 4
                assert all(r.json()["usage"]["completion_tokens"] == 32 for r in done)
                await wait_engine_idle(server.url, timeout=30)
        assert rss[-1] - rss[0] < 32 << 20, f"gateway RSS grew: {rss}"
    finally:
        server.stop()


async def test_hung_engine_is_detected_and_replaced(tmp_path: Path) -> None:
    server = Server(tmp_path, "--engine-heartbeat-timeout", "2",
                    env={"PAGEDSERVE_DEBUG_HANG_AFTER_STEPS": "40"})
    try:
        server.wait_ready()
        hung = server.engine_pid()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            events, _ = await asyncio.wait_for(
                stream_until_end(http, 1000, asyncio.Event()), 30)
            assert events[-1] == "[DONE]"
            assert "no heartbeat" in json.loads(events[-2])["error"]["message"]
            assert wait_gone(hung, 5), "the hung engine is killed"
            await wait_health(http, 200, 90)
            reply = await http.post("/v1/chat/completions", json=body(4))
            assert reply.status_code == 200
        server.engine_pids.add(server.engine_pid())
    finally:
        server.stop()
