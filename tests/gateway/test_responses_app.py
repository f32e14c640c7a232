"""`POST /v1/responses` through the app against a scripted engine, read by openai-python's
`responses.stream()` helper, which builds the reply from the events as a client does."""

from __future__ import annotations

import openai
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

REPLY = "Hello there, how are you today?"


async def test_stream_helper_builds_the_reply_from_its_events(fake_engine: FakeEngine) -> None:
    async with serve(build_app(fake_engine, GatewaySettings())) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        async with client.responses.stream(model="test-model", input="hi") as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
    # NOTE: the helper adds each delta to the item at its `output_index`: every delta must
    # name the item that `output_item.added` opened
    [added] = [e for e in events if e.type == "response.output_item.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert {(d.output_index, d.item_id) for d in deltas} == {(0, added.item.id)}
    assert "".join(d.delta for d in deltas) == deltas[-1].snapshot == REPLY
    assert final.status == "completed" and final.output_text == REPLY
    assert [(o.type, o.id, o.status) for o in final.output] == [
        ("message", added.item.id, "completed")]
    assert events[-1].type == "response.completed"
    assert final.usage.output_tokens == len(fake_engine.reply_ids)
