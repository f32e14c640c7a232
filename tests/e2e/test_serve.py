"""`pagedserve serve` as a real subprocess (gateway + engine) on the bundled model, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import websockets

from tests.e2e.serve_support import bundled_server, wait_health

MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with bundled_server("--max-model-len", "512", "--num-gpu-blocks", "128",
                        "--max-num-seqs", "8") as running:
        yield running


@pytest.fixture
def url(server: tuple[str, subprocess.Popen[bytes]]) -> str:
    wait_health(server[0], 200, 120)  # NOTE: a previous test may have killed the engine
    return server[0]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_openai_client(url: str) -> None:
    client = _client(url)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                           temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.usage.completion_tokens == 12
    assert reply.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 12
    # the engine's timeline reaches the client in the final event of both shapes
    assert chunks[-2].choices[0].finish_reason == "length"
    for timeline in (reply.model_extra["timeline"], chunks[-2].model_extra["timeline"]):
        assert timeline["queued"] <= timeline["scheduled"] <= timeline["first_token"]
        assert timeline["first_token"] <= timeline["finished"]
        assert timeline["preemptions"] == timeline["recomputed_tokens"] == 0
        assert timeline["spec_draft_tokens"] == timeline["spec_accepted_tokens"] == 0
    seeded = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                        temperature=1.0, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    stop_word = text.split()[1]
    stopped = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                             temperature=0, stop=[stop_word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop_word not in stopped.choices[0].message.content
    assert text.startswith(stopped.choices[0].message.content)


def test_server_text_equals_in_process_llm(url: str) -> None:
    from engine import LLM, SamplingParams

    client = _client(url)
    model = client.models.list().data[0].id
    served = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                            temperature=0).choices[0].message.content
    llm = LLM(max_model_len=512, num_gpu_blocks=64)
    local = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert served == local


def test_prefix_cache_hits_show_in_usage_and_metrics(url: str) -> None:
    client = _client(url)
    model = client.models.list().data[0].id
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    messages = [system, {"role": "user", "content": "Name a colour."}]
    hits_before = _metric(url, "pagedserve_prefix_cache_hits_total")
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached < again.usage.prompt_tokens
    assert again.model_extra["timeline"]["cached_tokens"] == cached
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _metric(url, "pagedserve_prefix_cache_hits_total") - hits_before >= cached
    assert _metric(url, "pagedserve_prefix_cache_queries_total") > 0


def test_disconnect_frees_kv(url: str) -> None:
    total = _metric(url, "pagedserve_kv_blocks_total")
    body = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    # NOTE: a bounded wait, not a speed check: on a loaded machine one step can take seconds
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        if (_metric(url, "pagedserve_requests_running") == 0
                and _metric(url, "pagedserve_kv_blocks_free") == total):
            break
        time.sleep(0.1)
    assert _metric(url, "pagedserve_requests_running") == 0
    assert _metric(url, "pagedserve_kv_blocks_free") == total


async def test_websocket_three_streams(url: str) -> None:
    request = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    ws_url = url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(ws_url, subprotocols=["pagedserve.v1"]) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for gen_id in ("a", "b", "c"):
            await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": request}))
        seen: dict[str, int] = {}
        done: dict[str, dict] = {}
        while len(done) < 3:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if frame["type"] == "generation.delta":
                seen[frame["id"]] = seen.get(frame["id"], 0) + 1
                if frame["id"] == "b" and seen["b"] == 2:
                    await ws.send(json.dumps({"type": "cancel", "id": "b"}))
            elif frame["type"] == "generation.done":
                done[frame["id"]] = frame
    assert done["b"]["status"] == "cancelled"
    assert done["a"]["status"] == done["c"]["status"] == "completed"
    async with websockets.connect(ws_url, subprotocols=["pagedserve.v1"]) as ws:
        await ws.recv()
        for gen_id in ("x", "y", "z"):
            await ws.send(json.dumps({"type": "generate", "id": gen_id,
                                      "request": {**request, "max_tokens": 400}}))
        for _ in range(6):
            await asyncio.wait_for(ws.recv(), 60)
    for _ in range(30):  # NOTE: engine stats arrive with outputs or the ~1 s heartbeat
        if _metric(url, "pagedserve_requests_running") == 0:
            break
        await asyncio.sleep(0.1)
    assert _metric(url, "pagedserve_requests_running") == 0


BAD = [
    (b"{", 400, "invalid_json"),
    (b"[]", 400, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400,
     "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": "nope"}', 404,
     "model_not_found"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400,
     "context_length_exceeded"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', 400, "invalid_json"),
]


@pytest.mark.parametrize("body, status, code", BAD)
def test_bad_input(url: str, body: bytes, status: int, code: str) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_engine_killed_mid_stream(url: str) -> None:
    engine_pid = _engine_pid(url)
    body = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        os.kill(engine_pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert json.loads(rest[-2][6:])["error"]
    assert rest[-1] == "data: [DONE]"
    assert httpx.get(f"{url}/health").status_code == 503
    wait_health(url, 200, 120)
    reply = _client(url).completions.create(model=_model(url), prompt="Hi",
                                            max_tokens=4)
    assert reply.choices[0].text


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def _engine_pid(url: str) -> int:
    # NOTE: -ww: without it ps cuts lines at $COLUMNS (pytest sets it), and a long checkout
    # path pushed `--port N` out of the gateway's line
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True,
                         text=True).stdout
    gateway = [line.split()[0] for line in out.splitlines() if "gateway.cli" in line
               and f"--port {port}" in line]
    engines = [int(line.split()[0]) for line in out.splitlines()
               if "-m engine" in line and line.split()[1] in gateway]
    assert engines, out
    return engines[0]
