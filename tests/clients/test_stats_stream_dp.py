"""The live view's stats stream on a real data-parallel server with an API key: one entry per
engine, each moving under load, and the key required."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from tiny_server import metric, running_server, wait_idle

pytestmark = pytest.mark.timeout(240)
KEY = "stats-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def _snapshots(http: httpx.AsyncClient, seen: list[dict]) -> None:
    async with http.stream("GET", "/v1/stats/stream", headers=AUTH) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                seen.extend(data if isinstance(data, list) else [data])


async def _both_engines_ready(seen: list[dict]) -> None:
    """NOTE: the server is healthy once one engine is ready; the router sends every request to
    that one until the other is ready too, and the stream lists only ready engines."""
    deadline = time.monotonic() + 120
    while not (seen and len(seen[-1]["engines"]) == 2):
        assert time.monotonic() < deadline, "the second engine never became ready"
        await asyncio.sleep(0.2)


async def _both_engines_busy(http: httpx.AsyncClient, seen: list[dict]) -> None:
    await _both_engines_ready(seen)
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
    load = [asyncio.create_task(http.post("/v1/completions", headers=AUTH,
                                          json={**body, "seed": i})) for i in range(4)]
    deadline = time.monotonic() + 120
    busy: set[str] = set()
    while busy != {"engine 0", "engine 1"} and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        busy = {e["engine"] for s in seen for e in s["engines"]
                if e["generation_tokens_per_s"] > 0 and e["running"] > 0}
    replies = await asyncio.gather(*load)
    assert busy == {"engine 0", "engine 1"}
    assert all(r.status_code == 200 for r in replies)


async def test_each_engine_of_a_data_parallel_server() -> None:
    with running_server("--data-parallel-size", "2", "--api-key", KEY) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            assert (await http.get("/v1/stats/stream")).status_code == 401
            seen: list[dict] = []
            reader = asyncio.create_task(_snapshots(http, seen))
            try:
                await _both_engines_busy(http, seen)
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            last = seen[-1]["engines"]
            # the per-engine pools add up to what /metrics reports for the whole pool
            total = metric(url, "pagedserve_kv_blocks_total")
            assert sum(e["kv_blocks_total"] for e in last) == total
        assert wait_idle(url) == 0
