"""An Anthropic Messages body as the chat request it means, and the fields refused by name."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.api.anthropic_translate import decode_messages, to_chat
from gateway.api.anthropic_types import CountTokensRequest, MessagesRequest
from gateway.errors import ApiError

WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


def _chat(**body):
    body = {"model": "m", "max_tokens": 8, **body}
    return to_chat(decode_messages(json.dumps(body).encode(), MessagesRequest))


def _refused(body: dict, kind: type = MessagesRequest) -> ApiError:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            **body}
    with pytest.raises(ApiError) as info:
        to_chat(decode_messages(json.dumps(body).encode(), kind))
    assert info.value.status == 400
    return info.value


def test_a_tool_round_trip_becomes_chat_messages() -> None:
    chat = _chat(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                 messages=[
                     {"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hmm", "signature": "s"},
                         {"type": "text", "text": "Checking."},
                         {"type": "tool_use", "id": "t1", "name": "get_weather",
                          "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": [
                             {"type": "text", "text": "sunny"}]},
                         {"type": "tool_result", "tool_use_id": "t2", "content": "down",
                          "is_error": True},
                         {"type": "text", "text": "And tomorrow?"}]}],
                 tools=[WEATHER], stop_sequences=["END"], temperature=0.5, top_k=3)
    got = [{k: v for k, v in msgspec.to_builtins(m).items() if v is not None}
           for m in chat.messages]
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
             "type": "function"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "t2"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tools[0].function.name == "get_weather"
    assert chat.tools[0].function.parameters == {"type": "object"}
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["END"], 0.5, 3, 8)
    assert chat.request_id.startswith("msg_")


@pytest.mark.parametrize("choice, chat_choice, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", True),
])
def test_tool_choice(choice: dict, chat_choice: str, parallel: bool) -> None:
    chat = _chat(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                 tool_choice=choice)
    assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel)


def test_named_tool_choice_and_thinking_switch() -> None:
    chat = _chat(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                 tool_choice={"type": "tool", "name": "get_weather"},
                 thinking={"type": "disabled"})
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    chat = _chat(messages=[{"role": "user", "content": "x"}], max_tokens=64,
                 thinking={"type": "enabled", "budget_tokens": 64})
    assert chat.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("body, param", [
    ({"container": "c"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, "mcp_servers"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4}}, "thinking.budget_tokens"),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "Rome"}]}]}, "tools[0].input_examples"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
])
def test_refused_fields_are_named(body: dict, param: str) -> None:
    error = _refused(body)
    assert error.param == param, error.message


def test_missing_max_tokens_is_named_and_count_tokens_needs_none() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as info:
        decode_messages(json.dumps(body).encode(), MessagesRequest)
    assert info.value.param == "max_tokens"
    chat = to_chat(decode_messages(json.dumps(body).encode(), CountTokensRequest))
    assert chat.max_tokens is None and chat.messages[0].content == "hi"


def test_a_final_assistant_turn_is_continued() -> None:
    chat = _chat(messages=[{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "The answer is"}])
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert not _chat(messages=[{"role": "user", "content": "x"}]).continue_final_message
    error = _refused({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]}]})
    assert error.param == "messages[1].content"
