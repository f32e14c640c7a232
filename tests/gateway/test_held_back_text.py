"""Text the parsers hold back (what may begin `<think>` or `<tool_call>`) comes out whole once
the reply ends, on every route, streamed and not: the scripted engine says the reply, each
official SDK reads it, and the answer is the reply's text, with no reasoning and no call."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

# ends that begin a marker of the reasoning parser (`<`) or of the tool-call parser (`<tool`)
REPLIES = ["x is 1 <", "a < b, and <tool"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": SCHEMA}
HI = [{"role": "user", "content": "hi"}]


async def _chat(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = await client.chat.completions.create(model="test-model", messages=HI,
                                                 tools=[CHAT_TOOL])
    message = whole.choices[0].message
    assert message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert getattr(message, "reasoning_content", None) is None
    streamed = await client.chat.completions.create(model="test-model", messages=HI,
                                                    tools=[CHAT_TOOL], stream=True)
    deltas = [c.choices[0].delta async for c in streamed if c.choices]
    assert not any(d.tool_calls or getattr(d, "reasoning_content", None) for d in deltas)
    return [message.content or "", "".join(d.content or "" for d in deltas)]


async def _completions(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = await client.completions.create(model="test-model", prompt="hi")
    streamed = await client.completions.create(model="test-model", prompt="hi", stream=True)
    return [whole.choices[0].text, "".join([c.choices[0].text async for c in streamed])]


async def _responses(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = await client.responses.create(model="test-model", input="hi",
                                          tools=[RESPONSES_TOOL])
    assert [o.type for o in whole.output] == ["message"]
    async with client.responses.stream(model="test-model", input="hi",
                                       tools=[RESPONSES_TOOL]) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert [o.type for o in final.output] == ["message"]
    return [whole.output_text, "".join(deltas), final.output_text]


async def _messages(url: str) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
    whole = await client.messages.create(model="test-model", max_tokens=64, messages=HI,
                                         tools=[ANTHROPIC_TOOL])
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "end_turn"
    async with client.messages.stream(model="test-model", max_tokens=64, messages=HI,
                                      tools=[ANTHROPIC_TOOL]) as stream:
        deltas = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text"]
    return [whole.content[0].text, "".join(deltas), final.content[0].text]


@pytest.mark.parametrize("route", [_chat, _completions, _responses, _messages],
                         ids=["chat", "completions", "responses", "messages"])
@pytest.mark.parametrize("reply", REPLIES, ids=["ends-lt", "ends-lt-tool"])
async def test_held_back_text_comes_out_at_the_end(tokenizer_dir: Path, route, reply: str
                                                   ) -> None:
    engine = FakeEngine(tokenizer_dir, reply=reply, interval=0.0, max_model_len=1024)
    assert engine.tokenizer.decode(engine.reply_ids) == reply
    settings = GatewaySettings(reasoning_parser="qwen3", tool_call_parser="hermes")
    async with serve(build_app(engine, settings)) as url:
        texts = await route(url)
    assert texts == [reply] * len(texts)
