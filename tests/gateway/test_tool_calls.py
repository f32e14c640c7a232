"""Tool calls and structured outputs in the gateway: the streaming Hermes parser against
json.loads of the whole text, the prompt a template without tools branch gets, the forced-call
grammar (checked by llguidance itself), and the 400s for fields that cannot be honoured."""

from __future__ import annotations

import json

import llguidance
import msgspec
import pytest

from engine.sched.structured.tokenizer import build_lltokenizer
from gateway.errors import ApiError
from gateway.requests import ChatCompletionRequest
from gateway.structured import structured_for, tool_call_grammar
from gateway.tokenizer import Tokenizer
from gateway.tools.hermes import HermesParser
from gateway.tools.prompt import template_messages
from gateway.validate import decode_request

TOOL = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q", "n"]}}}
REPLY = ('Let me check. <tool_call>\n{"name": "lookup", "arguments": {"q": "caf\u00e9 \\"x\\" {}", '
         '"n": 3}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"q": "b", '
         '"n": [1]}}\n</tool_call>')


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


@pytest.mark.parametrize("step", [1, 2, 7, len(REPLY)])
def test_streamed_calls_equal_the_whole_text_parsed(step):
    parser = HermesParser()
    events = []
    for i in range(0, len(REPLY), step):
        events += parser.feed(REPLY[i : i + step])
    events += parser.feed("", final=True)
    assert "".join(e.content for e in events if e.index is None) == "Let me check. "
    starts = [e for e in events if e.name is not None]
    assert [(e.index, e.name) for e in starts] == [(0, "lookup"), (1, "lookup")]
    for index, (call_id, name, args) in enumerate(parser.calls):
        assert name == "lookup"
        first = next(i for i, e in enumerate(events) if e.index == index)
        assert events[first].id == call_id  # the name and id come before any argument
        fragments = "".join(e.arguments for e in events if e.index == index)
        expected = json.loads(REPLY.split("<tool_call>\n")[index + 1].split("\n</tool_call>")[0])
        assert json.loads(fragments) == expected["arguments"] and fragments == args


def test_a_partial_tag_is_held_back_and_plain_text_passes():
    parser = HermesParser()
    assert [e.content for e in parser.feed("abc <tool_")] == ["abc "]
    assert [e.content for e in parser.feed("box> no call", final=True)] == ["<tool_box> no call"]
    assert parser.calls == []


def test_fallback_prompt_renders_tools_calls_and_results(bundled_tokenizer_dir):
    tok = Tokenizer(bundled_tokenizer_dir)
    assert not tok.has_tools_branch  # SmolLM2's template ignores tools
    request = _request(tools=[TOOL], messages=[
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": '{"q": "x", "n": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    messages = [{"role": m.role, "content": m.content or ""} for m in request.messages]
    messages, tools = template_messages(request, messages, tok.has_tools_branch)
    assert tools is None and messages[0]["role"] == "system"
    text = tok.render_chat(messages)
    assert '<tools>\n{"type": "function", "function": {"name": "lookup"' in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 1}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>" in text


def test_forced_call_grammar_accepts_only_valid_calls(bundled_tokenizer_dir):
    tok = build_lltokenizer(bundled_tokenizer_dir, 49152, [2])
    grammar = llguidance.LLMatcher.grammar_from_lark(
        tool_call_grammar([msgspec.convert(TOOL, type=_tool_type())], parallel=False))
    good = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a", "n": 2}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>'
    for text, ok in ((good, True), (bad, False)):
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        ids = tok.tokenize_str(text)
        accepted = matcher.try_consume_tokens(ids) == len(ids)
        assert accepted == ok and (matcher.is_accepting() or not ok)


def _tool_type():
    from gateway.requests import Tool

    return Tool


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_requests_that_cannot_be_honoured_are_400s(fields, param):
    with pytest.raises(ApiError) as err:
        structured_for(_request(**fields))
    assert err.value.status == 400 and err.value.param == param


def test_which_field_constrains_the_output():
    assert structured_for(_request(response_format={"type": "text"})) is None
    assert structured_for(_request(tools=[TOOL])) is None  # auto: parsed, not forced
    assert structured_for(_request(response_format={"type": "json_object"})).json_object
    forced = structured_for(_request(tools=[TOOL], tool_choice="required"))
    assert forced.param == "tools" and "%json" in forced.grammar
    so = structured_for(_request(structured_outputs={"json": {"type": "string"}}))
    assert json.loads(so.json) == {"type": "string"} and so.param == "structured_outputs"
