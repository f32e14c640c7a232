"""bench.serve against real tiny-model servers on 127.0.0.1: pagedserve and the hf-static one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from bench import plots, procs, serve

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pagedserve_url(tiny_model_dir: Path) -> Iterator[str]:
    port = serve.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--model",
         str(tiny_model_dir), "--max-model-len", "512", "--num-gpu-blocks", "128",
         "--max-num-seqs", "8", "--shutdown-timeout", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_health(url, proc, 180, "pagedserve")
        yield url
    finally:
        procs.stop(proc)


@pytest.fixture(scope="module")
def hf_static_url(tiny_model_dir: Path) -> Iterator[str]:
    with serve.baseline_server(str(tiny_model_dir), batch_size=2, startup_timeout=180) as url:
        yield url


def test_hf_static_answers_openai_streaming(hf_static_url: str) -> None:
    url = hf_static_url
    assert httpx.get(f"{url}/health").json()["server"] == "hf-static-baseline"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    done = client.completions.create(model=model, prompt="Once upon", max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 3
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{", timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()


def test_hf_static_batch_members_stop_at_their_own_length(hf_static_url: str) -> None:
    def ask(n: int) -> int:
        body = {"prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True}
        return httpx.post(f"{hf_static_url}/v1/completions", json=body,
                          timeout=60).json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as pool:  # NOTE: batch size 2: two batches of mixed lengths
        assert list(pool.map(ask, [2, 7, 1, 4])) == [2, 7, 1, 4]


def test_hf_static_failed_batch_answers_with_an_error(hf_static_url: str) -> None:
    body = {"prompt": [10**7], "max_tokens": 2}  # NOTE: out of vocabulary: generate raises
    failed = httpx.post(f"{hf_static_url}/v1/completions", json=body, timeout=60)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", f"{hf_static_url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data:")]
    assert '"error"' in lines[0] and lines[-1] == "data: [DONE]"
    ok = httpx.post(f"{hf_static_url}/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert ok.json()["usage"]["completion_tokens"] == 2  # the batcher still serves


def test_serve_bench_both_systems(pagedserve_url: str, hf_static_url: str,
                                  tmp_path: Path) -> None:
    result = serve.main([
        "--url", pagedserve_url, "--baseline", "hf-static", "--baseline-url", hf_static_url,
        "--baseline-batch-size", "2", "--request-rates", "8",
        "--concurrency", "2", "--num-requests", "4", "--distribution", "mixed",
        "--max-output-len", "6", "--max-prompt-len", "24", "--duration", "30",
        "--out-dir", str(tmp_path), "--no-progress"])
    saved = json.loads((tmp_path / "serve_results.json").read_text())
    assert saved["systems"].keys() == {"pagedserve", "hf-static"}
    for system in saved["systems"].values():
        points = system["rate"] + system["concurrency"]
        assert [p.get("request_rate", p.get("concurrency")) for p in points] == [8, 2]
        for p in points:
            assert p["num_requests"] == 4 and p["num_ok"] == 4 and p["errors"] == {}
            assert p["output_tokens"] == sum(min(6, n) for n in _mixed_outputs())
            assert 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"] <= p["e2e_s"]["p99"]
            assert p["itl_s"]["p50"] is not None and p["tpot_s"]["p50"] is not None
            assert p["output_tokens_per_s"] > 0 and p["requests_per_s"] > 0
            assert 0 <= p["goodput_requests_per_s"] <= p["requests_per_s"]
    assert saved["ratios_vs_hf_static"]["rate"][0]["output_tokens_per_s"] > 0
    for name in ("latency_vs_rate.png", "throughput_vs_concurrency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result["files"]) == 3
    for name in ("latency_vs_rate.png", "throughput_vs_concurrency.png"):
        (tmp_path / name).unlink()
    plots.main([str(tmp_path / "serve_results.json")])  # redrawn from the saved JSON
    assert (tmp_path / "latency_vs_rate.png").is_file()


def _mixed_outputs() -> list[int]:
    from bench.workloads import make_workload

    return [s.output_len for s in make_workload("mixed", 4, seed=0)]
