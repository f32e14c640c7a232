"""Streamed tool calls in the llama3_json and mistral formats through the gateway (a scripted
engine replies in the format) with the official `openai` client: the SDK reassembles the calls;
a call is sent once its JSON closed, in one delta carrying index, id, type, name and the whole
arguments (gateway/choice_events.py: a call cut short is never sent); a special-token opening is
kept in the text the parser reads."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

ARGS = {"city": "K\u00f8benhavn \u6771\u4eac", "unit": "celsius"}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
REPLIES = {
    "llama3_json": json.dumps({"name": "get_weather", "parameters": ARGS}, ensure_ascii=False),
    "mistral": "Sure. [TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": ARGS}],
                                                  ensure_ascii=False),
}


async def _stream_calls(engine: FakeEngine, parser: str, **fields):
    app = build_app(engine, GatewaySettings(tool_call_parser=parser))  # type: ignore[arg-type]
    async with serve(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        async with client.chat.completions.stream(
                model="test-model", messages=[{"role": "user", "content": "weather?"}],
                tools=[TOOL], **fields) as stream:
            chunks = [e.chunk async for e in stream if e.type == "chunk"]
            final = await stream.get_final_completion()
        whole = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "weather?"}],
            tools=[TOOL], **fields)
    return chunks, final, whole


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
async def test_streamed_calls_reassemble(tokenizer_dir: Path, parser: str) -> None:
    engine = FakeEngine(tokenizer_dir, reply=REPLIES[parser], interval=0.0, max_model_len=1024)
    chunks, final, whole = await _stream_calls(engine, parser)
    for reply in (final, whole):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == ARGS
        assert (choice.message.content or "").strip() == ("Sure." if parser == "mistral" else "")
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # NOTE: some tokens of the reply hold half a character; no fragment may carry one
    assert any(engine.tokenizer.decode([t]).endswith("\ufffd") for t in engine.reply_ids)
    assert not any("\ufffd" in (d.function.arguments or "") for d in deltas)
    assert len(deltas) == 1
    first = deltas[0]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id == final.choices[0].message.tool_calls[0].id
    assert json.loads(first.function.arguments) == ARGS
    if parser == "mistral":
        assert len(first.id) == 9 and first.id.isalnum()
    # the engine was asked for the call in this format: auto + strict = a grammar from tools
    grammar = engine.submitted[0].sampling.structured_outputs.grammar
    if parser == "mistral":
        assert 'lead[lazy]: TEXT "[TOOL_CALLS]"' in grammar
    else:
        assert '"parameters"' in grammar and "[TOOL_CALLS]" not in grammar


async def test_a_special_token_opening_is_kept_for_the_parser(tokenizer_dir: Path,
                                                              tmp_path: Path) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    new_id = max(t["id"] for t in spec["added_tokens"]) + 1
    new_id = max(new_id, len(spec["model"]["vocab"]))
    spec["added_tokens"].append({"id": new_id, "content": "[TOOL_CALLS]", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file() and name != "tokenizer.json":
            (tmp_path / name).write_text((tokenizer_dir / name).read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    engine = FakeEngine(tmp_path, reply=REPLIES["mistral"], interval=0.0, max_model_len=1024)
    assert new_id in engine.reply_ids  # the engine sends the opening as one special token
    chunks, final, whole = await _stream_calls(engine, "mistral", tool_choice="required")
    for reply in (final, whole):
        assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == ARGS
    sampling = engine.submitted[0].sampling
    assert sampling.skip_special_tokens is False
    assert sampling.structured_outputs.grammar.startswith(f"start: <[{new_id}]>")


@pytest.mark.parametrize("reply", [
    '{"answer": 42}', '{"user": {"name": "get_weather"}, "age": 3}',
    '{"name": "no_such_tool", "parameters": {"city": "Oslo"}}'])
async def test_json_that_is_no_call_is_the_same_content_streamed_or_not(
        tokenizer_dir: Path, reply: str) -> None:
    """llama3_json: a JSON reply that calls none of the request's tools is the reply's text,
    streamed or not, and finishes `stop` with no tool_calls."""
    engine = FakeEngine(tokenizer_dir, reply=reply, interval=0.0, max_model_len=1024)
    chunks, final, whole = await _stream_calls(engine, "llama3_json")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == reply
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    for r in (final, whole):
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
