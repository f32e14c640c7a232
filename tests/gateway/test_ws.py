"""The `pagedserve.v1` WebSocket protocol against a scripted engine, and the slow-reader outbox."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import websockets
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings
from gateway.ws import Outbox

REQUEST = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}


def _ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/ws"


async def _recv(ws: websockets.ClientConnection) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 5))


async def _until_done(ws: websockets.ClientConnection, ids: set[str]) -> list[dict]:
    frames = []
    while ids:
        frame = await _recv(ws)
        frames.append(frame)
        if frame["type"] in ("generation.done", "error"):
            ids.discard(frame.get("id"))
    return frames


async def test_interleaved_generations_and_cancel(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    app = build_app(fake_engine, GatewaySettings())
    async with serve(app) as url, websockets.connect(
        _ws_url(url), subprotocols=["pagedserve.v1"]
    ) as ws:
        assert ws.subprotocol == "pagedserve.v1"
        assert (await _recv(ws))["type"] == "session.created"
        for gen_id in ("a", "b", "c"):
            await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": REQUEST}))
        await ws.send(json.dumps({"type": "ping"}))
        frames = []
        while sum(f["type"] == "generation.delta" and f["id"] == "b" for f in frames) < 2:
            frames.append(await _recv(ws))
        await ws.send(json.dumps({"type": "cancel", "id": "b"}))
        frames += await _until_done(ws, {"a", "b", "c"})
    assert {"type": "pong"} in frames
    done = {f["id"]: f for f in frames if f["type"] == "generation.done"}
    assert done["b"]["status"] == "cancelled" and done["b"]["finish_reason"] == "abort"
    assert done["a"]["status"] == done["c"]["status"] == "completed"
    assert done["a"]["timeline"]["preemptions"] == 1  # the engine's counts reach the client
    assert done["b"]["timeline"]["preemptions"] is None  # cancelled: the gateway ended it
    assert done["b"]["timeline"]["finished"] >= done["b"]["timeline"]["first_token"]
    for gen_id in ("a", "c"):
        deltas = [f for f in frames if f["type"] == "generation.delta" and f["id"] == gen_id]
        assert [d["seq"] for d in deltas] == list(range(len(deltas)))
        text = "".join(d["chunk"]["choices"][0]["delta"].get("content", "") for d in deltas)
        assert text == "Hello there, how are you today?"
        assert deltas[0]["chunk"]["choices"][0]["delta"]["role"] == "assistant"
    ids = [f["type"] for f in frames if f.get("id") == "a"]
    assert ids[0] == "generation.started" and ids[-1] == "generation.done"
    started_b = next(f for f in frames if f["type"] == "generation.started" and f["id"] == "b")
    assert started_b["request_id"] in fake_engine.aborted


async def test_close_aborts_all_and_errors(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.2
    app = build_app(fake_engine, GatewaySettings())
    async with serve(app) as url:
        async with websockets.connect(_ws_url(url), subprotocols=["pagedserve.v1"]) as ws:
            await _recv(ws)
            await ws.send("not json")
            assert (await _recv(ws))["error"]["code"] == "invalid_frame"
            bad = {**REQUEST, "temperature": -1}
            await ws.send(json.dumps({"type": "generate", "id": "x", "request": bad}))
            error = await _recv(ws)
            assert error["id"] == "x" and error["error"]["param"] == "temperature"
            for gen_id in ("a", "b", "c"):
                await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": REQUEST}))
            await ws.send(json.dumps({"type": "generate", "id": "a", "request": REQUEST}))
            started = [await _recv(ws) for _ in range(4)]
            assert any(f.get("error", {}).get("code") == "duplicate_id" for f in started)
        for _ in range(50):
            if not app.state.gateway.generations:
                break
            await asyncio.sleep(0.02)
        assert app.state.gateway.generations == {}
        assert len(set(fake_engine.aborted)) == 3


async def test_auth_and_origin(fake_engine: FakeEngine) -> None:
    settings = GatewaySettings(api_key="k3y", allowed_origins=("http://good.example",))
    async with serve(build_app(fake_engine, settings)) as url:
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(_ws_url(url), subprotocols=["pagedserve.v1"]):
                pass
        # the browser's way to send a key: a `bearer.<key>` subprotocol, checked as a header is
        with pytest.raises(websockets.InvalidStatus) as wrong:
            async with websockets.connect(
                _ws_url(url), subprotocols=["pagedserve.v1", "bearer.wrong"]
            ):
                pass
        assert wrong.value.response.status_code == 403
        async with websockets.connect(
            _ws_url(url), subprotocols=["pagedserve.v1", "bearer.k3y"]
        ) as ws:
            assert ws.subprotocol == "pagedserve.v1"
            assert (await _recv(ws))["type"] == "session.created"
        async with websockets.connect(
            _ws_url(url), additional_headers={"Authorization": "Bearer k3y"},
            origin="http://good.example",
        ) as ws:
            assert (await _recv(ws))["type"] == "session.created"
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(
                _ws_url(url), additional_headers={"Authorization": "Bearer k3y"},
                origin="http://evil.example",
            ):
                pass


async def test_a_resumed_socket_hears_its_generations_failure(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    app = build_app(fake_engine, GatewaySettings())
    request = {**REQUEST, "resumable": True}
    async with serve(app) as url:
        async with websockets.connect(_ws_url(url), subprotocols=["pagedserve.v1"]) as first:
            await _recv(first)
            await first.send(json.dumps({"type": "generate", "id": "a", "request": request}))
            started = await _recv(first)
            assert (await _recv(first))["type"] == "generation.delta"
            fake_engine.interval = 600  # NOTE: it cannot finish before the engine dies
        # the socket is gone; the generation runs on, then its engine dies
        fake_engine.kill()
        stream = app.state.gateway.streams.streams[started["stream_id"]]
        async with asyncio.timeout(10):
            while not stream.done:
                await asyncio.sleep(0.02)
        async with websockets.connect(_ws_url(url), subprotocols=["pagedserve.v1"]) as again:
            await _recv(again)
            await again.send(json.dumps({"type": "resume", "id": "b",
                                         "stream_id": started["stream_id"], "after_seq": 0}))
            frames = await _until_done(again, {"b"})  # NOTE: without its end, a 5 s timeout
            # the whole stream was replayed at once: a second end would be queued by now
            await again.send(json.dumps({"type": "ping"}))
            while (frame := await _recv(again))["type"] != "pong":
                frames.append(frame)
    assert frames[0]["type"] == "generation.resumed"
    ends = [f for f in frames if f["type"] in ("generation.done", "error")]
    assert ends == [{"type": "error", "id": "b", "error": ends[0]["error"]}]
    assert ends[0]["error"]["code"] == "engine_error"


async def test_draining_is_announced(fake_engine: FakeEngine) -> None:
    app = build_app(fake_engine, GatewaySettings())
    async with serve(app) as url, websockets.connect(_ws_url(url)) as ws:
        await _recv(ws)
        app.state.gateway.begin_drain()
        assert (await _recv(ws))["type"] == "session.draining"
        await ws.send(json.dumps({"type": "generate", "id": "a", "request": REQUEST}))
        assert (await _recv(ws))["error"]["code"] == "server_draining"


def _delta(gen_id: str, text: str) -> dict:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": None}]}
    return {"type": "generation.delta", "id": gen_id, "chunk": chunk}


async def test_outbox_coalesces_then_overflows() -> None:
    box = Outbox(max_frames=4, max_chars=50)
    for i in range(10):
        box.push(_delta("a", str(i)))
        box.push(_delta("b", "x"))
    assert len(box) == 2 and not box.overflowed  # one merged delta per id
    first = await box.pop()
    assert first["chunk"]["choices"][0]["delta"]["content"] == "0123456789"
    box.push({"type": "generation.done", "id": "a"})
    box.push(_delta("a", "new"))  # nothing merges past a done frame
    assert len(box) == 3
    box.push(_delta("c", "y" * 60))
    assert box.overflowed and await box.pop() is None


def _counted(gw, reason: str) -> float:
    return gw.metrics.requests.labels(finish_reason=reason)._value.get()


async def test_cancel_before_the_task_first_runs(fake_engine: FakeEngine) -> None:
    """The race itself: the generation's task is cancelled before its first step."""
    from gateway.service import Gateway
    from gateway.ws import Session, State

    gw = Gateway(fake_engine, GatewaySettings(max_queued_requests=1))
    session = Session(gw, SimpleNamespace(headers={}))  # type: ignore[arg-type]
    session.state = State.OPEN
    await session._handle(json.dumps({"type": "generate", "id": "b", "request": REQUEST}))
    await session._handle(json.dumps({"type": "cancel", "id": "b"}))  # the task has not run yet
    for _ in range(100):
        if not gw.generations and not session.tasks and not session.endings:
            break
        await asyncio.sleep(0.01)
    frames = [await session.outbox.pop() for _ in range(len(session.outbox))]
    ends = [f for f in frames if f["type"] in ("generation.done", "error")]
    assert len(ends) == 1 and ends[0]["status"] == "cancelled"
    assert ends[0]["finish_reason"] == "abort"
    started = next(f for f in frames if f["type"] == "generation.started")
    assert started["request_id"] in fake_engine.aborted
    assert gw.generations == {} and session.tasks == {} and gw.num_waiting == 0
    assert _counted(gw, "abort") == 1


async def test_generate_generate_cancel_back_to_back(fake_engine: FakeEngine) -> None:
    """`generate a`, `generate b`, `cancel b` in a row on a fresh server, with a queue of 1."""
    fake_engine.interval = 0.02
    app = build_app(fake_engine, GatewaySettings(max_queued_requests=2))
    gw = app.state.gateway
    async with serve(app) as url, websockets.connect(
        _ws_url(url), subprotocols=["pagedserve.v1"]
    ) as ws:
        await _recv(ws)
        for _ in range(3):
            for frame in ({"type": "generate", "id": "a", "request": REQUEST},
                          {"type": "generate", "id": "b", "request": REQUEST},
                          {"type": "cancel", "id": "b"}):
                await ws.send(json.dumps(frame))
            frames = await _until_done(ws, {"a", "b"})
            ends = [f for f in frames if f["type"] in ("generation.done", "error")]
            assert sorted(f["id"] for f in ends) == ["a", "b"]
            done = {f["id"]: f for f in ends}
            assert done["b"]["status"] == "cancelled" and done["a"]["status"] == "completed"
        assert gw.generations == {} and gw.num_waiting == 0
    assert _counted(gw, "abort") == 3 and _counted(gw, "stop") == 3
    started_b = [m.request_id for m in fake_engine.submitted][1::2]
    assert set(started_b) <= set(fake_engine.aborted)


async def test_n_choices_over_the_websocket(fake_engine: FakeEngine) -> None:
    app = build_app(fake_engine, GatewaySettings())
    async with serve(app) as url, websockets.connect(
        _ws_url(url), subprotocols=["pagedserve.v1"]
    ) as ws:
        await _recv(ws)
        await ws.send(json.dumps({"type": "generate", "id": "g",
                                  "request": {**REQUEST, "n": 2}}))
        frames = await _until_done(ws, {"g"})
    texts: dict[int, str] = {0: "", 1: ""}
    for f in frames:
        if f["type"] == "generation.delta":
            for choice in f["chunk"]["choices"]:
                texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: "Hello there, how are you today?", 1: "Hello there, how are you today?"}
    done = frames[-1]
    assert done["finish_reasons"] == ["stop", "stop"] and done["finish_reason"] == "stop"
    assert done["usage"]["completion_tokens"] == 2 * len(fake_engine.reply_ids)


def test_outbox_merges_choices_by_index() -> None:
    box = Outbox(8)

    def delta(index: int, text: str) -> dict:
        return {"type": "generation.delta", "id": "g", "chunk": {"choices": [
            {"index": index, "delta": {"content": text}, "logprobs": None,
             "finish_reason": None}]}}

    for frame in (delta(0, "a"), delta(1, "b"), delta(0, "c")):
        box.push(frame)
    assert len(box) == 1
    merged = box._frames[0]["chunk"]["choices"]
    assert [(c["index"], c["delta"]["content"]) for c in merged] == [(0, "ac"), (1, "b")]


async def test_deltas_carry_the_reasoning_split(tokenizer_dir) -> None:
    reply = "I weigh it up</think>Hello there"
    engine = FakeEngine(tokenizer_dir, reply=reply, interval=0.001)
    app = build_app(engine, GatewaySettings(reasoning_parser="deepseek_r1"))
    async with serve(app) as url, websockets.connect(
        _ws_url(url), subprotocols=["pagedserve.v1"]
    ) as ws:
        assert (await _recv(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "generate", "id": "r", "request": REQUEST}))
        frames = await _until_done(ws, {"r"})
    deltas = [f["chunk"]["choices"][0]["delta"] for f in frames
              if f["type"] == "generation.delta"]
    want_reasoning, _, want_content = reply.partition("</think>")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == want_reasoning
    assert "".join(d.get("reasoning") or "" for d in deltas) == want_reasoning
    assert "".join(d.get("content") or "" for d in deltas) == want_content
    done = next(f for f in frames if f["type"] == "generation.done")
    assert done["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_merged_deltas_keep_reasoning_and_calls() -> None:
    box = Outbox(max_frames=8)
    for delta in ({"reasoning_content": "a"}, {"reasoning_content": "b", "content": "c"},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}):
        box.push({"type": "generation.delta", "id": "g", "chunk": {"choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]}})
    merged = box._frames[0]["chunk"]["choices"][0]["delta"]
    assert merged["reasoning_content"] == "ab" and merged["content"] == "c"
    assert merged["tool_calls"] == [{"index": 0, "function": {"arguments": "{"}}]
