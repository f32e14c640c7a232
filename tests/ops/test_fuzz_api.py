"""Property tests of the gateway's input handling (Starlette app, scripted engine): every HTTP
body and WebSocket frame gets a result or a 4xx in the OpenAI error shape, never a 5xx or a hang."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from gateway_fakes import FakeEngine, serve
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from websockets.sync.client import connect

from gateway.app import build_app
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
        | st.text(max_size=12))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
text = st.text(max_size=30)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": text}), min_size=1,
    max_size=3)
stops = st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3)
common = {
    "model": st.just("test-model"), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "max_tokens": st.integers(1, 20), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop": stops, "priority": st.integers(-5, 5),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=2),
}
valid_chat = st.fixed_dictionaries({"messages": messages}, optional={
    **common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": st.integers(1, 20), "add_generation_prompt": st.booleans()})
valid_completion = st.fixed_dictionaries({"prompt": text.filter(str.strip) | st.lists(
    st.integers(0, 49151), min_size=1, max_size=5)}, optional={
    **common, "logprobs": st.integers(0, 5), "echo": st.booleans()})

items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                           "content": text | st.lists(st.fixed_dictionaries(
                               {"type": st.just("input_text"), "text": text}), max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text,
                           "name": st.just("f"), "arguments": st.just('{"a": 1}')}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                           "output": text})), min_size=1, max_size=3)
tool = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"]),
                              "parameters": st.just({"type": "object"})})
common_responses = {k: v for k, v in common.items()
                    if k not in ("max_tokens", "stream_options", "stream")}
# NOTE: `stream` always set, so that about half the valid bodies are streamed
valid_responses = st.fixed_dictionaries({"input": text.filter(str.strip) | items,
                                         "stream": st.booleans()}, optional={
    **common_responses, "max_output_tokens": st.integers(1, 20), "instructions": text,
    "store": st.booleans(), "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
    "previous_response_id": st.just("resp_unknown"), "metadata": st.just({"k": "v"})})
blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
valid_messages = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": text | blocks}), min_size=1,
    max_size=3), "max_tokens": st.integers(1, 20)}, optional={
    "model": st.just("test-model"), "stream": st.booleans(), "system": text | blocks,
    "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "metadata": st.fixed_dictionaries({"user_id": st.text(max_size=6)})})
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=5)
valid_embeddings = st.fixed_dictionaries({"input": text | st.lists(text, min_size=1, max_size=3)
                                          | token_ids | st.lists(token_ids, max_size=2)},
                                         optional={
    "model": st.just("test-model"), "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.integers(1, 10), "user": text, "normalize": st.booleans()})
documents = st.lists(text | st.fixed_dictionaries({"text": text}), max_size=3)
valid_rerank = st.fixed_dictionaries({"query": text, "documents": documents}, optional={
    "model": st.just("test-model"), "top_n": st.integers(0, 4),
    "return_documents": st.booleans()})
valid_score = st.fixed_dictionaries({"text_1": text | st.lists(text, max_size=3),
                                     "text_2": text | st.lists(text, max_size=3)})


def mutated(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[Any]:
    """A valid body, or one with a single field replaced by anything, dropped, or added;
    sometimes not an object at all."""

    def mutate(body: dict) -> st.SearchStrategy[Any]:
        keys = sorted(body) or ["messages"]
        return st.one_of(
            st.just(body),
            st.tuples(st.sampled_from(keys), anything).map(lambda kv: {**body, kv[0]: kv[1]}),
            st.sampled_from(keys).map(lambda k: {n: v for n, v in body.items() if n != k}),
            st.tuples(st.text(max_size=8), anything).map(lambda kv: {**body, kv[0]: kv[1]}),
        )

    return valid.flatmap(mutate) | anything


chat_body = mutated(valid_chat)
completion_body = mutated(valid_completion)
responses_body = mutated(valid_responses)
messages_body = mutated(valid_messages)
embeddings_body = mutated(valid_embeddings)
rerank_body = mutated(valid_rerank)
score_body = mutated(valid_score)


def encode(body: Any, mangle: int) -> bytes:
    """JSON (NaN and Infinity included, as Python writes them), sometimes truncated."""
    raw = json.dumps(body).encode()
    return raw[: len(raw) * mangle // 4] if mangle else raw


TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def check_error(payload: Any) -> None:
    error = payload["error"]
    assert isinstance(error["message"], str) and isinstance(error["code"], str)
    assert isinstance(error["type"], str) and "param" in error


def check_anthropic_error(payload: Any) -> None:
    assert payload["type"] == "error" and isinstance(payload["error"]["message"], str)
    assert payload["error"]["type"] in ("invalid_request_error", "not_found_error",
                                        "request_too_large", "authentication_error")


def check_anthropic(response: Any) -> None:
    """/v1/messages: Anthropic's error shape; a stream of named events ending message_stop."""
    if response.status_code >= 400:
        check_anthropic_error(response.json())
    elif response.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop", names
    else:
        body = response.json()
        assert "input_tokens" in body if "count_tokens" in str(response.url) else body["content"]


def check_response(response: Any) -> None:
    event(f"status {response.status_code}")  # NOTE: --hypothesis-show-statistics shows the mix
    assert response.status_code < 500, response.text
    if "/v1/messages" in str(response.url):
        check_anthropic(response)
    elif response.status_code >= 400:
        check_error(response.json())
    elif response.headers["content-type"].startswith("text/event-stream"):
        data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        if data[-1] != "[DONE]":  # /v1/responses: numbered events, one terminal one
            events = [json.loads(item) for item in data]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            ends = [e["type"] for e in events if e["type"] in TERMINAL]
            assert ends == [events[-1]["type"]] and ends[0] != "response.failed"
            return
        for item in data[:-1]:
            assert "error" not in json.loads(item)  # NOTE: the scripted engine never fails
    else:
        payload = response.json()
        if "/v1/embeddings" in str(response.url) or "score" in str(response.url):
            assert payload["data"] and payload["usage"]["total_tokens"] >= 0
        elif "rerank" in str(response.url):
            assert all(r["relevance_score"] == r["relevance_score"] for r in payload["results"])
        else:
            assert payload["choices"] if "choices" in payload else payload["output"]


@pytest.fixture(scope="module")
def client(bundled_tokenizer_dir: Path) -> Any:
    engine = FakeEngine(bundled_tokenizer_dir, interval=0.0)
    app = build_app(engine, GatewaySettings(max_body_bytes=8192))
    with TestClient(app) as http:
        yield http


@pytest.mark.parametrize("path, bodies", [("/v1/chat/completions", chat_body),
                                          ("/v1/completions", completion_body),
                                          ("/v1/responses", responses_body),
                                          ("/v1/messages", messages_body),
                                          ("/v1/messages/count_tokens", messages_body),
                                          ("/v1/embeddings", embeddings_body),
                                          ("/v1/rerank", rerank_body),
                                          ("/score", score_body)])
def test_http_bodies_never_5xx(client: TestClient, path: str, bodies: Any) -> None:
    @SETTINGS
    @given(body=bodies, mangle=st.sampled_from([0, 0, 0, 0, 0, 1, 3]))
    def run(body: Any, mangle: int) -> None:
        check_response(client.post(path, content=encode(body, mangle),
                                   headers={"content-type": "application/json"}))

    run()


PATHS = ["/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
         "/v1/responses/resp_x", "/health", "/livez", "/version", "/metrics",
         "/v1/requests/x/cancel", "/nope", "/v1/../health", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/messages/nope", "/v1/embeddings", "/v1/rerank",
         "/rerank", "/v2/rerank", "/score", "/v1/score"]


@SETTINGS
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(PATHS) | st.text(max_size=20).map(lambda t: "/" + quote(t)),
       body=st.binary(max_size=300))
def test_raw_requests_never_5xx(client: TestClient, method: str, path: str, body: bytes) -> None:
    response = client.request(method, path, content=body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and path.startswith("/v1/messages"):
        check_anthropic_error(response.json())
    elif response.status_code >= 400 and path.startswith("/v1"):
        check_error(response.json())


frame = (st.fixed_dictionaries({"type": st.just("generate"), "id": st.text(max_size=4) | anything,
                                "request": chat_body | anything})
         | st.fixed_dictionaries({"type": st.just("cancel"), "id": st.text(max_size=4) | anything})
         | st.fixed_dictionaries({"type": st.sampled_from(["ping", "pong", "bogus"])})
         | anything)
KNOWN = {"session.created", "generation.started", "generation.delta", "generation.done",
         "error", "pong"}


@pytest.fixture(scope="module")
def ws_url(bundled_tokenizer_dir: Path) -> Iterator[str]:
    """The app under uvicorn in a thread of its own: sessions end the way they do in
    production (TestClient cancels the app at exit, racing the session's own close)."""
    started: queue.SimpleQueue[str] = queue.SimpleQueue()
    stop = threading.Event()

    async def main() -> None:
        app = build_app(FakeEngine(bundled_tokenizer_dir, interval=0.0), GatewaySettings())
        async with serve(app) as url:
            started.put(url.replace("http://", "ws://") + "/v1/ws")
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    yield started.get(timeout=30)
    stop.set()
    thread.join(15)


@SETTINGS
@given(frames=st.lists(frame.map(json.dumps) | st.text(max_size=30) | st.binary(max_size=30),
                       min_size=1, max_size=6))
def test_websocket_frames_never_break_the_session(ws_url: str, frames: list[str | bytes]) -> None:
    with connect(ws_url, subprotocols=["pagedserve.v1"], open_timeout=10) as ws:
        assert json.loads(ws.recv(10))["type"] == "session.created"
        for item in frames:
            ws.send(item)
        ws.send('{"type": "ping"}')
        while True:  # NOTE: frames are handled in order, so the pong comes after their answers
            got = json.loads(ws.recv(10))
            assert got["type"] in KNOWN, got
            if got["type"] == "error":
                check_error(got)
            if got["type"] == "pong":
                break
