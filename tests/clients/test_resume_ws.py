"""Resumable WebSocket generations against a real server on the tiny model: a socket drops
mid-generation, a new socket of the same key sends `resume` and gets the rest of that run."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from resume_support import GRACE, chat_body, metric_value, metrics_text
from tiny_server import MODEL_NAME, running_server, wait_idle
from websockets.asyncio.client import ClientConnection, connect

ENGINE = f'model_name="{MODEL_NAME}"'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server("--stream-grace-period", str(GRACE)) as base:
        yield base


async def _socket(url: str, key: str) -> ClientConnection:
    ws = await connect(url.replace("http", "ws") + "/v1/ws", subprotocols=["pagedserve.v1"],  # type: ignore[list-item]
                       additional_headers={"Authorization": f"Bearer {key}"})
    assert json.loads(await ws.recv())["type"] == "session.created"
    return ws


def _request(max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = chat_body(max_tokens, **extra)
    del body["stream"], body["stream_options"]
    return body


async def _frames(ws: ClientConnection, until: int | None = None) -> list[dict[str, Any]]:
    """Frames up to the generation's last (or `until` deltas)."""
    frames: list[dict[str, Any]] = []
    deltas = 0
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
        frames.append(frame)
        deltas += frame["type"] == "generation.delta"
        if frame["type"] in ("generation.done", "error") or deltas == until:
            return frames


def _text(frames: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for f in frames
                   if f["type"] == "generation.delta" for c in f["chunk"]["choices"])


def _last_seq(frames: list[dict[str, Any]]) -> int:
    return [f["seq"] for f in frames if f["type"] == "generation.delta"][-1]


async def test_resume_on_a_new_socket_is_the_same_run(url: str) -> None:
    ws = await _socket(url, "alice")
    await ws.send(json.dumps({"type": "generate", "id": "ref", "request": _request(40)}))
    reference = _text(await _frames(ws))
    await ws.close()
    await asyncio.to_thread(wait_idle, url)
    text0 = await asyncio.to_thread(metrics_text, url)
    request = _request(40, resumable=True, cache_salt=uuid.uuid4().hex)
    ws = await _socket(url, "alice")
    await ws.send(json.dumps({"type": "generate", "id": "g1", "request": request}))
    first = await _frames(ws, until=4)
    started = first[0]
    assert started["type"] == "generation.started" and started["stream_id"]
    ws.transport.abort()  # the network drops: no close frame
    # NOTE: another key cannot take it over
    other = await _socket(url, "bob")
    await other.send(json.dumps({"type": "resume", "id": "g1", "stream_id": started["stream_id"],
                                 "after_seq": 0}))
    refused = await _frames(other)
    assert refused[-1]["error"]["code"] == "stream_not_found" and refused[-1]["id"] == "g1"
    await other.close()
    again = await _socket(url, "alice")
    after = _last_seq(first)
    await again.send(json.dumps({"type": "resume", "id": "g1", "stream_id": started["stream_id"],
                                 "after_seq": after}))
    rest = await _frames(again)
    await again.close()
    assert rest[0] == {"type": "generation.resumed", "id": "g1", "after_seq": after,
                       "stream_id": started["stream_id"], "request_id": started["request_id"]}
    seqs = [f["seq"] for f in first + rest if f["type"] == "generation.delta"]
    # NOTE: the backlog may arrive merged into one delta (it carries its last seq)
    assert seqs == sorted(set(seqs)) and min(f["seq"] for f in rest[1:-1]) > after
    assert _text(first) + _text(rest) == reference and reference
    done = rest[-1]
    assert done["type"] == "generation.done" and done["status"] == "completed"
    assert sum(f["type"] == "generation.done" for f in first + rest) == 1

    def counted() -> tuple[float, float]:
        text = metrics_text(url)
        return (metric_value(text, "vllm:prompt_tokens_total", ENGINE)
                - metric_value(text0, "vllm:prompt_tokens_total", ENGINE),
                metric_value(text, "vllm:generation_tokens_total", ENGINE)
                - metric_value(text0, "vllm:generation_tokens_total", ENGINE))

    for _ in range(300):
        prompt, generated = await asyncio.to_thread(counted)
        if generated >= 40:
            break
        await asyncio.sleep(0.1)
    assert (prompt, generated) == (done["usage"]["prompt_tokens"], 40)  # one prefill


async def test_expired_generation_is_aborted(url: str) -> None:
    ws = await _socket(url, "carol")
    await ws.send(json.dumps({"type": "generate", "id": "long",
                              "request": _request(4000, resumable=True)}))
    first = await _frames(ws, until=2)
    stream_id = first[0]["stream_id"]
    ws.transport.abort()
    aborted0 = metric_value(await asyncio.to_thread(metrics_text, url),
                            "pagedserve_streams_expired_aborted_total")
    for _ in range(int((GRACE + 60) * 10)):
        text = await asyncio.to_thread(metrics_text, url)
        if metric_value(text, "pagedserve_streams_expired_aborted_total") > aborted0:
            break
        await asyncio.sleep(0.1)
    # NOTE: the counter was read after the drop: the expiry may already have been counted
    again = await _socket(url, "carol")
    await again.send(json.dumps({"type": "resume", "id": "long", "stream_id": stream_id,
                                 "after_seq": _last_seq(first)}))
    error = (await _frames(again))[-1]
    await again.close()
    assert error["type"] == "error" and error["error"]["code"] == "stream_expired"
    assert await asyncio.to_thread(wait_idle, url, 30) == 0


async def test_cancel_a_resumed_generation(url: str) -> None:
    ws = await _socket(url, "dave")
    await ws.send(json.dumps({"type": "generate", "id": "c", "request": _request(
        4000, resumable=True)}))
    first = await _frames(ws, until=2)
    await ws.close()
    again = await _socket(url, "dave")
    await again.send(json.dumps({"type": "resume", "id": "c2", "stream_id": first[0]["stream_id"],
                                 "after_seq": _last_seq(first)}))
    await _frames(again, until=1)
    await again.send(json.dumps({"type": "cancel", "id": "c2"}))
    rest = await _frames(again)
    await again.close()
    assert rest[-1]["type"] == "generation.done" and rest[-1]["status"] == "cancelled"
    assert rest[-1]["id"] == "c2"
    assert await asyncio.to_thread(wait_idle, url, 30) == 0
