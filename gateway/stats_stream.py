"""The live engine view's feed (`GET /v1/stats/stream`): once a second a JSON snapshot of each
engine's stats and the gateway's latency percentiles, kept for the last minutes, as SSE.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import Histogram

from ipc.messages import EngineStats

SAMPLE_S = 1.0  # one snapshot a second
HISTORY = 300  # snapshots kept (and sent to a new reader first): the last five minutes
WINDOW_S = 30.0  # latency percentiles over the tokens of the last this many seconds
QUANTILES = (0.5, 0.9, 0.99)
# NOTE: a sample this long after the previous one starts a new history (nobody watched in
# between; rates over the gap would be averages the plots cannot show as such)
_GAP_S = 5.0

EngineStatsOf = Callable[[], Sequence[tuple[str, EngineStats | None]]]


@dataclass(frozen=True)
class _Raw:
    """What one sample read: cumulative counters, to difference against later samples."""

    t: float  # monotonic
    engines: dict[str, EngineStats]
    ttft: list[tuple[float, float]]  # (upper bound, cumulative count) per bucket
    itl: list[tuple[float, float]]


def buckets_of(histogram: Histogram) -> list[tuple[float, float]]:
    """A prometheus_client histogram's cumulative buckets as (upper bound, count)."""
    samples = histogram.collect()[0].samples
    return [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket the rank falls in; None when
    the window saw no observation; the largest finite bound when it falls in +Inf."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _window_percentiles(now: list[tuple[float, float]], then: list[tuple[float, float]] | None
                        ) -> dict[str, float | None]:
    if then is None:
        # NOTE: no earlier sample, no window. The counts since the server started are not one:
        # shown as the "last 30 s", an idle server's first snapshot after the dashboard was
        # reopened said TTFT p99 145 s (and that point held the plot's scale for 5 minutes)
        return {f"p{round(q * 100)}": None for q in QUANTILES}
    window = [(b, c - c0) for (b, c), (_, c0) in zip(now, then, strict=True)]
    return {f"p{round(q * 100)}": quantile(q, window) for q in QUANTILES}


def _rate(now: int, then: int, seconds: float) -> float:
    return max(0, now - then) / seconds if seconds > 0 else 0.0


def engine_snapshot(name: str, s: EngineStats, prev: EngineStats | None,
                    seconds: float) -> dict[str, Any]:
    """One engine's numbers: gauges as they are, counters as rates over the last sample."""
    p = prev or s
    queries = s.prefix_cache_queries - p.prefix_cache_queries
    hits = s.prefix_cache_hits - p.prefix_cache_hits
    used = s.kv_blocks_total - s.kv_blocks_free
    return {
        "engine": name,
        "kv_cache_usage": used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        "kv_blocks_used": used, "kv_blocks_total": s.kv_blocks_total,
        "running": s.num_running, "waiting": s.num_waiting, "swapped": s.num_swapped,
        # NOTE: None while no prompt was looked up in the interval (no rate to show)
        "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
        "prefix_cache_hit_rate_total": (s.prefix_cache_hits / s.prefix_cache_queries
                                        if s.prefix_cache_queries else None),
        "prompt_tokens_per_s": _rate(s.prompt_tokens, p.prompt_tokens, seconds),
        "generation_tokens_per_s": _rate(s.generation_tokens, p.generation_tokens, seconds),
        "preemptions": s.num_preemptions,
    }


class StatsFeed:
    """Samples when a reader is due one (no task runs while nobody watches); every reader
    gets the same snapshots, numbered by `seq`."""

    def __init__(self, engines: EngineStatsOf, ttft: Histogram, itl: Histogram,
                 in_flight: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engines = engines
        self._ttft = ttft
        self._itl = itl
        self._in_flight = in_flight
        self._clock = clock  # seconds, monotonic (tests step a fake one)
        self._raw: deque[_Raw] = deque(maxlen=int(WINDOW_S / SAMPLE_S) + 2)
        self.snapshots: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._seq = 0

    def sample(self) -> None:
        """Take a snapshot if the last one is a period old (or there is none)."""
        now = self._clock()
        last = self._raw[-1] if self._raw else None
        if last is not None and now - last.t < SAMPLE_S * 0.95:
            return
        if last is not None and now - last.t > _GAP_S:
            self._raw.clear()
            last = None
        raw = _Raw(now, {n: s for n, s in self._engines() if s is not None},
                   buckets_of(self._ttft), buckets_of(self._itl))
        old = next((r for r in self._raw if now - r.t <= WINDOW_S + SAMPLE_S / 2), None)
        self._raw.append(raw)
        seconds = now - last.t if last is not None else 0.0
        self._seq += 1
        self.snapshots.append({
            "seq": self._seq, "time": time.time(), "interval_s": seconds,
            "requests_in_flight": self._in_flight(),
            "engines": [engine_snapshot(n, s, last.engines.get(n) if last else None, seconds)
                        for n, s in raw.engines.items()],
            "ttft_seconds": _window_percentiles(raw.ttft, old.ttft if old else None),
            "itl_seconds": _window_percentiles(raw.itl, old.itl if old else None),
            "latency_window_s": now - old.t if old is not None else None,
        })

    def due_in(self) -> float:
        last = self._raw[-1].t if self._raw else 0.0
        return max(0.0, last + SAMPLE_S - self._clock())

    async def events(self) -> AsyncIterator[bytes]:
        """The kept history first (one `history` event), then each new snapshot."""
        self.sample()
        history = list(self.snapshots)
        sent = history[-1]["seq"] if history else 0
        yield b"event: history\ndata: " + msgspec.json.encode(history) + b"\n\n"
        while True:
            await asyncio.sleep(self.due_in())
            self.sample()
            for snap in [s for s in self.snapshots if s["seq"] > sent]:
                sent = snap["seq"]
                yield b"id: %d\ndata: " % sent + msgspec.json.encode(snap) + b"\n\n"
