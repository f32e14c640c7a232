"""The live view's feed, GET /v1/stats/stream: percentiles, per-engine rates, key, schema."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.openapi import STATS_SNAPSHOT
from gateway.settings import GatewaySettings
from gateway.stats_stream import quantile
from ipc.messages import EngineStats

pytestmark = pytest.mark.timeout(60)
INF = float("inf")


def test_quantile_is_prometheus_histogram_quantile() -> None:
    # NOTE: reference values worked by hand from Prometheus' documented rule (linear
    # interpolation inside the bucket holding rank q * count)
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert quantile(0.1, buckets) == pytest.approx(0.1 * 1 / 2)
    assert quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 3 / 4)
    assert quantile(0.99, [(0.1, 0.0), (1.0, 1.0), (INF, 4.0)]) == 1.0  # in +Inf: top bound
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None


async def _events(response: httpx.Response) -> Any:
    """(event name, parsed data) of each SSE event."""
    name, data = None, []
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            yield name, json.loads("\n".join(data))
            name, data = None, []


async def test_snapshots_rates_percentiles_and_key(fake_engine: FakeEngine) -> None:
    fake_engine.first_delay = 0.3
    app = build_app(fake_engine, GatewaySettings(api_key="sekret"))
    auth = {"Authorization": "Bearer sekret"}
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        refused = await http.get("/v1/stats/stream")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        async with http.stream("GET", "/v1/stats/stream", headers=auth) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response)
            name, history = await anext(events)
            assert name == "history" and isinstance(history, list)
            for snap in history:
                jsonschema.validate(snap, STATS_SNAPSHOT)
            # counters set between two snapshots become rates over the interval
            fake_engine.stats = EngineStats(kv_blocks_total=64, kv_blocks_free=48, num_running=3,
                                            num_waiting=2, num_swapped=1, prompt_tokens=1000,
                                            generation_tokens=500, prefix_cache_queries=100,
                                            prefix_cache_hits=25)
            _, before = await anext(events)
            fake_engine.stats = EngineStats(kv_blocks_total=64, kv_blocks_free=32, num_running=3,
                                            prompt_tokens=1600, generation_tokens=800,
                                            prefix_cache_queries=300, prefix_cache_hits=175)
            _, after = await anext(events)
            jsonschema.validate(after, STATS_SNAPSHOT)
            assert after["seq"] == before["seq"] + 1
            (engine,) = after["engines"]
            dt = after["interval_s"]
            assert dt > 0
            assert engine["engine"] == "engine 0" and engine["kv_cache_usage"] == 0.5
            assert engine["prompt_tokens_per_s"] == pytest.approx(600 / dt)
            assert engine["generation_tokens_per_s"] == pytest.approx(300 / dt)
            assert engine["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
            assert engine["prefix_cache_hit_rate_total"] == pytest.approx(175 / 300)
            assert before["engines"][0]["running"] == 3
            assert (before["engines"][0]["waiting"], before["engines"][0]["swapped"]) == (2, 1)
            # requests through the gateway fill the TTFT and ITL percentiles of the window
            replies = [http.post("/v1/completions", headers=auth,
                                 json={"prompt": "hi", "max_tokens": 4}) for _ in range(3)]
            assert all(r.status_code == 200 for r in await asyncio.gather(*replies))
            snap = after
            while snap["ttft_seconds"]["p50"] is None:
                _, snap = await anext(events)
            assert snap["ttft_seconds"]["p50"] >= 0.25  # every TTFT is over first_delay
            assert snap["itl_seconds"]["p99"] is not None


async def test_a_new_reader_gets_the_history(fake_engine: FakeEngine) -> None:
    app = build_app(fake_engine)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("GET", "/v1/stats/stream") as first:
            events = _events(first)
            await anext(events)
            seqs = [(await anext(events))[1]["seq"] for _ in range(2)]
        async with http.stream("GET", "/v1/stats/stream") as second:
            _, history = await anext(_events(second))
        assert [s["seq"] for s in history][:3] == [seqs[0] - 1, *seqs]
