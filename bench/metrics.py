"""Latency statistics for the serving benchmark: per-request records, percentiles, goodput.

Pure functions over plain numbers, so the math is tested on synthetic data.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one streamed request did; times in seconds from its own send."""

    ok: bool = False
    error: str | None = None  # kind of failure: "http_429", "timeout", "stream_error", ...
    ttft: float | None = None  # first content chunk
    chunk_times: list[float] = field(default_factory=list)  # every content chunk
    e2e: float | None = None  # last byte
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks (a chunk may carry several tokens)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """A request is good when it succeeded, its TTFT is under `ttft` and its TPOT under `itl`."""

    ttft: float = 2.0
    itl: float = 0.2

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None or r.ttft >= self.ttft:
            return False
        return r.tpot is None or r.tpot < self.itl


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO) -> dict:
    """One load point's figures; `duration` is wall time from the first send to the last byte."""
    if duration <= 0:
        raise ValueError("duration must be > 0")
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": dict(Counter(r.error or "unknown" for r in records if not r.ok)),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "goodput_requests_per_s": sum(slo.met_by(r) for r in records) / duration,
        "slo": {"ttft_s": slo.ttft, "itl_s": slo.itl},
        "slo_attainment": sum(slo.met_by(r) for r in records) / len(records) if records else None,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": distribution([g for r in ok for g in r.itls]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
    }
