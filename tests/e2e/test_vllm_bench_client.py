"""`vllm bench serve`'s SSE reading rules against a real server whose queue makes requests wait
(the tiny model, one sequence at a time): every request must count as a success."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from vllm_bench_sse import count_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
from tiny_server import MODEL_NAME, running_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 64
MAX_TOKENS = 24


def test_parser_follows_vllm_rules() -> None:
    data = b'data: {"choices": [{"text": "a", "index": 0}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
    ok = count_stream([data, usage, b"data: [DONE]\n\n"])
    assert ok.success and ok.text == "a" and ok.output_tokens == 1
    # a lone comment loses its blank line to the strip and hides the next event
    glued = count_stream([b": ping\n\n", data, b"data: [DONE]\n\n"])
    assert not glued.success
    # a comment in the same read as the event is fine
    assert count_stream([b": ping\n\n" + data, b"data: [DONE]\n\n"]).success


async def _one(http: httpx.AsyncClient, i: int):
    body = {"model": MODEL_NAME, "prompt": f"Request {i}: tell me a story", "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "logprobs": None,
            "repetition_penalty": 1.0}
    reads: list[bytes] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for raw in response.aiter_raw():
            reads.append(raw)
    return count_stream(reads)


def test_queued_streams_all_count_as_successes() -> None:
    """64 concurrent streams behind --max-num-seqs 1: the last ones wait seconds for a token."""
    with running_server("--max-num-seqs", "1") as url:

        async def run():
            limits = httpx.Limits(max_connections=NUM_REQUESTS)
            async with httpx.AsyncClient(base_url=url, timeout=240, limits=limits) as http:
                return await asyncio.gather(*(_one(http, i) for i in range(NUM_REQUESTS)))

        results = asyncio.run(asyncio.wait_for(run(), 240))
        stats = httpx.get(f"{url}/metrics").text
    failed = [r.error for r in results if not r.success]
    assert failed == []
    assert all(r.output_tokens == MAX_TOKENS for r in results)
    assert "pagedserve_time_to_first_token_seconds_count 64.0" in stats
