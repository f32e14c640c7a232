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
from gateway.metrics import Metrics
from gateway.openapi import STATS_SNAPSHOT
from gateway.settings import GatewaySettings
from gateway.stats_stream import StatsFeed, quantile
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
            # 48 of 64 blocks free: a quarter of the pool in use
            assert before["engines"][0]["kv_cache_usage"] == 0.25
            assert before["engines"][0]["kv_blocks_used"] == 16
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


class _Clock:
    """A monotonic clock the test steps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _feed(clock: _Clock) -> tuple[StatsFeed, Metrics]:
    metrics = Metrics(lambda: None)
    engines = [("engine 0", EngineStats(kv_blocks_total=64, kv_blocks_free=64))]
    return StatsFeed(lambda: engines, metrics.ttft.ours, metrics.itl.ours, lambda: 0,
                     clock), metrics


def _ttft_at(feed: StatsFeed, clock: _Clock, t: float) -> dict[str, float | None]:
    clock.now = 1000.0 + t
    feed.sample()
    return feed.snapshots[-1]["ttft_seconds"]


def test_percentiles_cover_only_the_last_30_seconds() -> None:
    clock = _Clock()
    feed, metrics = _feed(clock)
    p99: dict[int, float | None] = {}
    for t in range(51):  # a reader watching: a sample a second
        if t == 1:
            metrics.ttft.observe(145.0)  # one slow request (in the 80..160 s bucket)
        if t == 11:
            metrics.ttft.observe(0.03)
        p99[t] = _ttft_at(feed, clock, t)["p99"]
    assert p99[0] is None  # nothing observed yet
    assert 80 < p99[20] <= 160  # both requests in the window
    assert p99[40] <= 0.05  # the slow one left the window: only the fast one
    assert p99[50] is None  # nothing in the last 30 s
    assert feed.snapshots[-1]["latency_window_s"] == pytest.approx(30.0)


def test_a_reopened_feed_shows_no_latency_from_before_it() -> None:
    # NOTE: the live bug: after the dashboard was closed a while, the first snapshot read the
    # counts since the server started as its window (TTFT p99 145 s on an idle server)
    clock = _Clock()
    feed, metrics = _feed(clock)
    _ttft_at(feed, clock, 0)
    metrics.ttft.observe(145.0)
    assert 80 < _ttft_at(feed, clock, 1)["p99"] <= 160  # seen while it was recent
    reopened = _ttft_at(feed, clock, 600)  # nobody watched for ten minutes
    assert reopened == {"p50": None, "p90": None, "p99": None}
    assert feed.snapshots[-1]["latency_window_s"] is None
    assert _ttft_at(feed, clock, 601)["p99"] is None  # idle: nothing in the window
    metrics.ttft.observe(0.03)
    assert _ttft_at(feed, clock, 602)["p99"] <= 0.05
