"""The prompt-text count (gateway/prompt_text.py) and where a conversation is rendered: every
field the template reads is counted, and above the threshold rendering runs on a thread."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest
from gateway_fakes import FakeEngine

from gateway.errors import ApiError
from gateway.prompt_text import prompt_text_sizes
from gateway.requests import ChatCompletionRequest
from gateway.service import _OFF_LOOP_CHARS, Gateway

TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Find a word",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "minLength": 2}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "ab"}'}}


def _request(**fields: object) -> ChatCompletionRequest:
    return msgspec.convert(fields, ChatCompletionRequest)


def test_every_rendered_string_is_counted() -> None:
    req = _request(messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}],
                              "name": "ann"},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "c1", "content": "found"}],
                   tools=[TOOL], chat_template_kwargs={"mode": "brief", "depth": 3})
    sizes = prompt_text_sizes(req.messages, req.tools,
                              {"chat_template_kwargs": req.chat_template_kwargs})
    # by hand: contents, the name, the call's id, name and arguments, the result's call id
    assert sizes["messages"] == 5 + 3 + (2 + 6 + 11) + (2 + 5)
    # name, description, then the schema's keys and strings, its one number as 1
    schema = "type" "object" "properties" "q" "type" "string" "minLength"
    assert sizes["tools"] == 6 + 11 + len(schema) + 1
    assert sizes["chat_template_kwargs"] == len("mode") + len("brief") + len("depth") + 1
    # a lower bound on the JSON the fallback tools prompt writes of them
    assert sizes["tools"] < len(json.dumps(TOOL))


def _threads_seen(gw: Gateway) -> list[str]:
    tok = gw.tokenizer()
    seen: list[str] = []
    render = tok.apply_chat_template

    def spy(*args: object, **kwargs: object) -> list[int]:
        seen.append(threading.current_thread().name)
        return render(*args, **kwargs)

    tok.apply_chat_template = spy  # type: ignore[method-assign]
    return seen


async def test_long_tools_render_off_the_loop(fake_engine: FakeEngine) -> None:
    gw = Gateway(fake_engine)
    seen = _threads_seen(gw)
    loop_thread = threading.current_thread().name
    short = _request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    long_tool = {**TOOL, "function": {**TOOL["function"], "description": "w " * _OFF_LOOP_CHARS}}
    long = _request(messages=[{"role": "user", "content": "hi"}], tools=[long_tool])
    short_ids = await gw.chat_prompt_ids(short)
    long_ids = await gw.chat_prompt_ids(long)
    assert seen[0] == loop_thread and seen[1] != loop_thread
    assert len(long_ids) > len(short_ids) + _OFF_LOOP_CHARS // 2  # the description is in it


async def test_too_much_tool_text_is_refused_before_rendering(fake_engine: FakeEngine) -> None:
    gw = Gateway(fake_engine)
    seen = _threads_seen(gw)
    limit = fake_engine.info.max_model_len * gw.tokenizer().max_token_chars  # type: ignore[union-attr]
    wide = {**TOOL, "function": {**TOOL["function"], "parameters": {
        "type": "object", "enum": list(range(limit))}}}  # each number counts one
    req = _request(messages=[{"role": "user", "content": "hi"}], tools=[wide])
    with pytest.raises(ApiError) as caught:
        await gw.chat_prompt_ids(req, fake_engine.info.max_model_len)  # type: ignore[union-attr]
    assert (caught.value.param, caught.value.code) == ("tools", "context_length_exceeded")
    assert seen == []


@pytest.mark.parametrize("field", ["documents", "chat_template", "chat_template_kwargs"])
async def test_other_rendered_fields_are_counted_before_rendering(
        fake_engine: FakeEngine, field: str) -> None:
    gw = Gateway(fake_engine)
    seen = _threads_seen(gw)
    limit = fake_engine.info.max_model_len * gw.tokenizer().max_token_chars  # type: ignore[union-attr]
    huge = "w" * (limit + 1)
    value = {"documents": [{"title": "t", "text": huge}], "chat_template": huge,
             "chat_template_kwargs": {"k": huge}}[field]
    req = _request(messages=[{"role": "user", "content": "hi"}], **{field: value})
    with pytest.raises(ApiError) as caught:
        await gw.chat_prompt_ids(req, fake_engine.info.max_model_len)  # type: ignore[union-attr]
    assert (caught.value.param, caught.value.code) == (field, "context_length_exceeded")
    assert seen == []  # refused before the template ran (or compiled)
