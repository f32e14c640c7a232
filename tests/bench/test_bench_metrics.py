"""bench.metrics on synthetic data: percentiles, TPOT, goodput under an SLO, error counts."""

from __future__ import annotations

import pytest

from bench.metrics import SLO, RequestRecord, percentile, summarize


def test_percentile_matches_linear_interpolation() -> None:
    data = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(data, 50) == pytest.approx(50.5)
    assert percentile(data, 90) == pytest.approx(90.1)
    assert percentile(data, 99) == pytest.approx(99.01)
    assert percentile(data, 0) == 1 and percentile(data, 100) == 100
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(data, 101)


def _rec(ttft: float, gap: float, n: int) -> RequestRecord:
    times = [ttft + i * gap for i in range(n)]
    return RequestRecord(ok=True, ttft=ttft, chunk_times=times, e2e=times[-1],
                         prompt_tokens=10, output_tokens=n)


def test_itl_and_tpot() -> None:
    r = _rec(0.5, 0.1, 5)
    assert r.itls == pytest.approx([0.1] * 4)
    assert r.tpot == pytest.approx(0.1)
    one = RequestRecord(ok=True, ttft=0.1, chunk_times=[0.1], e2e=0.1, output_tokens=1)
    assert one.tpot is None


def test_summary_and_goodput() -> None:
    slo = SLO(ttft=2.0, itl=0.2)
    records = [
        _rec(0.5, 0.1, 11),   # good
        _rec(1.0, 0.05, 11),  # good
        _rec(3.0, 0.1, 11),   # TTFT too slow
        _rec(0.5, 0.3, 11),   # ITL too slow
        RequestRecord(error="http_503"),
        RequestRecord(error="timeout"),
        RequestRecord(error="http_503"),
    ]
    s = summarize(records, duration=10.0, slo=slo)
    assert s["num_requests"] == 7 and s["num_ok"] == 4
    assert s["errors"] == {"http_503": 2, "timeout": 1}
    assert s["requests_per_s"] == pytest.approx(0.4)
    assert s["goodput_requests_per_s"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(2 / 7)
    assert s["output_tokens"] == 44
    assert s["output_tokens_per_s"] == pytest.approx(4.4)
    assert s["total_tokens_per_s"] == pytest.approx(8.4)
    assert s["ttft_s"]["p50"] == pytest.approx(0.75)
    assert s["ttft_s"]["mean"] == pytest.approx(1.25)
    assert s["tpot_s"]["p99"] == pytest.approx(0.3, abs=0.01)
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["e2e_s"]["p90"] is not None


def test_summary_with_no_successes() -> None:
    s = summarize([RequestRecord(error="connect")], duration=1.0, slo=SLO())
    assert s["num_ok"] == 0 and s["ttft_s"]["p50"] is None and s["goodput_requests_per_s"] == 0
    with pytest.raises(ValueError):
        summarize([], duration=0.0, slo=SLO())
