"""Resumable /v1/responses and /v1/messages streams against a real server on the tiny model
(started with `--resumable-streams`): dropped mid-way and resumed with `Last-Event-ID` (httpx),
parsed by the openai and anthropic SDKs, resumed by pagedserve's SDK across a network cut."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pagedserve_client as ps
import pytest
from resume_support import GRACE, CuttingProxy, finished_total, metric_value, metrics_text, wait_for
from tiny_server import MODEL_NAME, running_server, tiny_model_dir, wait_idle
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(300)
ENGINE = f'model_name="{MODEL_NAME}"'
STORY = "Tell a long story"
RESPONSES_END = {"response.completed", "response.incomplete", "response.failed", "error"}
MESSAGES_END = {"message_stop", "error"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # NOTE: the server default: a stream is resumable unless its request says `false`
    with running_server("--resumable-streams", "--stream-grace-period", str(GRACE)) as base:
        yield base


@pytest.fixture
def proxy(url: str) -> Iterator[CuttingProxy]:
    p = CuttingProxy(urlsplit(url).port or 0)
    yield p
    p.close()


@dataclass
class Event:
    id: str | None
    event: str | None
    data: dict[str, Any]
    fields: list[str] = field(default_factory=list)  # its lines' field names, in order


def read_events(source: httpx.Response | Iterator[str], stop_after: int | None = None
                ) -> list[Event]:
    """The SSE events of a response (comments skipped); with `stop_after`, return after that
    many (leaving the caller's stream context then drops the connection mid-stream). Pass the
    same `iter_lines()` to read one response in several parts."""
    out: list[Event] = []
    lines: list[str] = []
    for line in source.iter_lines() if isinstance(source, httpx.Response) else source:
        if line.startswith(":"):
            continue
        if line:
            lines.append(line)
            continue
        if lines:
            parts = dict(raw.partition(": ")[::2] for raw in lines)
            out.append(Event(parts.get("id"), parts.get("event"), json.loads(parts["data"]),
                             [raw.partition(":")[0] for raw in lines]))
            lines = []
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def _counters(url: str) -> tuple[float, float, float]:
    text = metrics_text(url)
    return (metric_value(text, "vllm:prompt_tokens_total", ENGINE),
            metric_value(text, "vllm:generation_tokens_total", ENGINE), finished_total(text))


def _one_run(url: str, before: tuple[float, float, float], prefill: int, tokens: int) -> None:
    """The engine prefilled once (`prefill` tokens) and generated `tokens` for one request."""
    wait_for(lambda: _counters(url)[1] >= before[1] + tokens, 30, "the engine's counters")
    after = _counters(url)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == \
        (prefill, tokens, 1)


def _drop_and_resume(url: str, path: str, body: dict[str, Any], events: int
                     ) -> tuple[str, list[Event], list[Event]]:
    """POST a stream, read `events` events, drop it, resume it after the last one read."""
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}{path}", json=body) as r:
            assert r.status_code == 200, r.read()
            stream_id = r.headers["x-stream-id"]
            first = read_events(r, stop_after=events)
        with client.stream("GET", f"{url}/v1/streams/{stream_id}",
                           headers={"Last-Event-ID": first[-1].id or ""}) as r:
            assert r.status_code == 200 and r.headers["x-stream-id"] == stream_id
            rest = read_events(r)
    return stream_id, first, rest


def _plain(url: str, path: str, body: dict[str, Any]) -> list[Event]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "resumable": False},
                      timeout=60) as r:
        assert r.status_code == 200 and "x-stream-id" not in r.headers
        events = read_events(r)
    assert all(e.id is None for e in events)
    return events


# ---- /v1/responses ---------------------------------------------------------------------------


def _responses_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "input": STORY, "max_output_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "store": False, **extra}


def _responses_text(events: list[Event]) -> str:
    return "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")


def test_responses_stream_resumes_with_last_event_id(url: str) -> None:
    reference = _plain(url, "/v1/responses", _responses_body(48))
    wait_idle(url)
    before = _counters(url)
    # NOTE: a salt of its own: no prefix-cache hit on the reference's blocks
    body = _responses_body(48, resumable=True, cache_salt=uuid.uuid4().hex)
    stream_id, first, rest = _drop_and_resume(url, "/v1/responses", body, 5)
    events = first + rest
    assert len(first) == 5 and rest
    assert [e.id for e in events] == [f"{stream_id}:{k}" for k in range(len(events))]
    assert [e.data["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e.event == e.data["type"] and e.fields == ["id", "event", "data"]
               for e in events)
    assert [e.event for e in events] == [e.event for e in reference]
    assert [e for e in events if e.event in RESPONSES_END] == [events[-1]]
    assert events[-1].event == "response.incomplete"  # NOTE: max_output_tokens ended it
    text = _responses_text(reference)
    assert _responses_text(events) == text and text
    final = events[-1].data["response"]
    assert "".join(p["text"] for item in final["output"] if item["type"] == "message"
                   for p in item["content"]) == text
    usage = final["usage"]
    _one_run(url, before, usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"],
             48)


def test_openai_sdk_parses_a_resumable_responses_stream(url: str) -> None:
    reference = _responses_text(_plain(url, "/v1/responses", _responses_body(24)))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model=MODEL_NAME, input=STORY, max_output_tokens=24, temperature=0, stream=True,
        store=False, extra_body={"resumable": True, "ignore_eos": True})
    assert raw.headers["x-stream-id"]
    events = list(raw.parse())
    assert type(events[-1]).__name__ == "ResponseIncompleteEvent"  # max_output_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference
    assert events[-1].response.output_text == reference


def test_resumable_needs_stream_in_each_routes_error_shape(url: str) -> None:
    refused = httpx.post(f"{url}/v1/responses", json={**_responses_body(4, resumable=True),
                                                      "stream": False}, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "resumable"
    body = {**_messages_body(4, {}), "stream": False, "resumable": True}
    refused = httpx.post(f"{url}/v1/messages", json=body, timeout=30)
    assert refused.status_code == 400
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "`resumable`" in error["error"]["message"]


def test_pagedserve_sdk_resumes_a_responses_stream(url: str, proxy: CuttingProxy) -> None:
    reference = _responses_text(_plain(url, "/v1/responses", _responses_body(300)))
    with ps.Client(url) as client:
        # NOTE: read to its end without a cut: its terminal event ends it (no [DONE] follows)
        stream = client.responses.create(**_responses_body(8, resumable=True))
        with stream:
            kinds = [event.type for event in stream]
        assert stream.stream_id and stream.resumes == 0 and kinds[-1] == "response.incomplete"
    seen: list[ps.ResponseStreamEvent] = []
    with ps.Client(proxy.url) as client:
        stream = client.responses.create(**_responses_body(300, resumable=True))
        with stream:
            for event in stream:
                seen.append(event)
                if len(seen) == 5:
                    proxy.cut(down_for=2.0)
    assert proxy.cuts == 1 and stream.resumes >= 1
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert [e.type for e in seen if e.type in RESPONSES_END] == ["response.incomplete"]
    assert "".join(e.delta or "" for e in seen if e.type == "response.output_text.delta") == \
        reference


# ---- /v1/messages ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_eos() -> dict[str, float]:
    """A logit_bias that keeps the random model from ending early (Messages has no
    ignore_eos)."""
    eos = AutoTokenizer.from_pretrained(tiny_model_dir()).eos_token_id
    return {str(eos): -100.0}


def _messages_body(max_tokens: int, bias: dict[str, float], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": STORY}], "logit_bias": bias, **extra}


def _messages_text(events: list[Event]) -> str:
    return "".join(e.data["delta"].get("text", "") for e in events
                   if e.event == "content_block_delta")


def test_messages_stream_resumes_with_its_event_names(url: str, no_eos: dict[str, float]) -> None:
    reference = _plain(url, "/v1/messages", _messages_body(40, no_eos))
    wait_idle(url)
    before = _counters(url)
    # NOTE: no `resumable` field: the server's --resumable-streams default makes it resumable
    stream_id, first, rest = _drop_and_resume(url, "/v1/messages", _messages_body(40, no_eos), 4)
    events = first + rest
    assert [e.id for e in events] == [f"{stream_id}:{k}" for k in range(len(events))]
    assert all(e.event == e.data["type"] and e.fields == ["id", "event", "data"]
               for e in events)
    assert [e.event for e in events] == [e.event for e in reference if e.event != "ping"]
    assert [e for e in events if e.event in MESSAGES_END] == [events[-1]]
    assert events[-1].event == "message_stop" and events[-2].data["usage"]["output_tokens"] == 40
    text = _messages_text(reference)
    assert _messages_text(events) == text and text
    _one_run(url, before, events[0].data["message"]["usage"]["input_tokens"], 40)


def test_anthropic_sdk_parses_a_resumable_stream(url: str, no_eos: dict[str, float]) -> None:
    reference = _messages_text(_plain(url, "/v1/messages", _messages_body(24, no_eos)))
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client, \
            client.messages.stream(model=MODEL_NAME, max_tokens=24, messages=[
                {"role": "user", "content": STORY}], extra_body={
                "temperature": 0, "logit_bias": no_eos, "resumable": True}) as stream:
        assert stream.response.headers["x-stream-id"]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reference and final.content[0].text == reference
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_delete_cancels_each_route_with_one_terminal_event(url: str,
                                                           no_eos: dict[str, float]) -> None:
    for path, body, end in (("/v1/responses", _responses_body(4000), "response.failed"),
                            ("/v1/messages", _messages_body(4000, no_eos), "error")):
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{url}{path}", json=body) as live:
            stream_id, lines = live.headers["x-stream-id"], live.iter_lines()
            seen = read_events(lines, stop_after=3)
            cancelled = client.delete(f"{url}/v1/streams/{stream_id}")
            assert cancelled.json()["cancelled"] is True
            seen += read_events(lines)  # the live reader sees it end, far short of 4000 tokens
        ends = RESPONSES_END if path == "/v1/responses" else MESSAGES_END
        assert [e.event for e in seen if e.event in ends] == [end] and seen[-1].event == end
        assert wait_idle(url, 30) == 0
    assert seen[-1].data["error"]["type"] == "api_error"  # Anthropic's shape, not OpenAI's
