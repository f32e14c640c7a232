"""/v1/messages against a scripted engine under a real uvicorn, read by the `anthropic` SDK:
a failure mid-stream is one `error` event, an engine that is down is 529, a cancel is not
retried, keep-alive pings, disconnects abort."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

HI = {"model": "test-model", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
REPLY = "Hello there, how are you today?"


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_reply_and_stream_events(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.0
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        reply = (await http.post("/v1/messages", json=HI)).json()
        assert reply["content"] == [{"type": "text", "text": REPLY}]
        assert reply["stop_reason"] == "end_turn" and reply["stop_sequence"] is None
        streamed = await http.post("/v1/messages", json={**HI, "stream": True})
    events = _events(streamed.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == REPLY
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


async def test_engine_failure_mid_stream_is_one_error_event(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/messages", json={**HI, "stream": True}) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line == "event: content_block_delta":
                    break
            fake_engine.kill()
            rest = [line async for line in lines if line]
        names = [line for line in rest if line.startswith("event: ")]
        assert names[-1] == "event: error" and "event: message_stop" not in names
        error = json.loads(rest[-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as sdk:
            with pytest.raises(anthropic.OverloadedError) as info:
                await sdk.messages.create(**HI)
        assert info.value.body["error"]["type"] == "overloaded_error"
        assert int(info.value.response.headers["retry-after"]) >= 1


async def test_a_cancel_is_an_error_the_sdk_does_not_retry(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    app = build_app(fake_engine)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http, \
            anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=2) as sdk:
        task = asyncio.create_task(sdk.messages.create(**HI))
        while not app.state.gateway.generations:
            await asyncio.sleep(0.01)
        (request_id,) = app.state.gateway.generations
        assert request_id.startswith("msg_")
        assert (await http.post(f"/v1/requests/{request_id}/cancel")).status_code == 200
        with pytest.raises(anthropic.InternalServerError) as info:
            await task
        assert "cancelled" in info.value.body["error"]["message"]
    assert len(fake_engine.submitted) == 1  # NOTE: x-should-retry: false, so not resent


async def test_pings_while_waiting(fake_engine: FakeEngine) -> None:
    fake_engine.first_delay, fake_engine.interval = 0.3, 0.0
    app = build_app(fake_engine, GatewaySettings(sse_keepalive_interval=0.05))
    async with serve(app) as url, \
            anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as sdk, \
            httpx.AsyncClient(base_url=url) as http:
        raw = await http.post("/v1/messages", json={**HI, "stream": True})
        async with sdk.messages.stream(**HI) as stream:
            final = await stream.get_final_message()
    assert _events(raw.text)[0][0] == "ping"
    assert final.content[0].text == REPLY


async def test_disconnects_abort(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.2
    app = build_app(fake_engine)
    async with serve(app) as url:
        for stream in (True, False):
            async with httpx.AsyncClient(base_url=url) as http:

                async def call(http: httpx.AsyncClient = http, stream: bool = stream) -> None:
                    async with http.stream("POST", "/v1/messages",
                                           json={**HI, "stream": stream}) as response:
                        await response.aread()

                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(call(), 0.5)
            for _ in range(100):
                if len(set(fake_engine.aborted)) == int(not stream) + 1:
                    break
                await asyncio.sleep(0.02)
            assert len(set(fake_engine.aborted)) == int(not stream) + 1
        assert app.state.gateway.generations == {}
