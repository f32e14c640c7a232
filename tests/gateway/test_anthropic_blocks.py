"""Anthropic content blocks from ChoiceEvents: the stream's events, parsed by the `anthropic`
SDK's own accumulator, give the same message as the JSON reply's blocks."""

from __future__ import annotations

import functools

import msgspec
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from gateway.api.anthropic_blocks import Blocks
from gateway.api.anthropic_messages import sse
from gateway.api.anthropic_types import MessageReply, MessageStart, MessageUsage
from gateway.choice_events import ChoiceEvents
from gateway.generation import Job, Piece
from gateway.tools.hermes import HermesParser
from ipc.sampling import SamplingParams


class _Marker:
    """A reasoning parser for the test: text before `|` is reasoning."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if self.done:
            return "", text
        head, sep, tail = text.partition("|")
        self.done = bool(sep)
        return head, tail

    def count(self, token_ids: list[int]) -> int:
        return 0 if self.done else len(token_ids)


def _run(job: Job, texts: list[str]) -> tuple[Blocks, list]:
    blocks, choice, events = Blocks(), ChoiceEvents(job), []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        events += blocks.feed(choice.feed(Piece(text, [5], finish_reason="stop" if last else None)))
    return blocks, events + blocks.finish()


def _sdk_message(events: list) -> object:
    """The message the SDK builds from the SSE bytes of message_start + `events`."""
    start = MessageStart(MessageReply("msg_1", "m", [], None, None, MessageUsage(3, 0)))
    snapshot, bufs = None, {}
    for event in [start, *events]:
        raw = sse(event)
        name, data = raw.split(b"\n")[:2]
        assert name == b"event: " + data.split(b'"type":"')[1].split(b'"')[0]
        payload = msgspec.json.decode(data.removeprefix(b"data: "))
        parsed = construct_type(type_=RawMessageStreamEvent, value=payload)
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def _job(**kw) -> Job:
    return Job("r", "chat", "m", [1], SamplingParams(max_tokens=8), **kw)


def test_thinking_then_text_blocks() -> None:
    blocks, events = _run(_job(reasoning_parser=_Marker), ["let me ", "think|", "Hel", "lo"])
    content = msgspec.to_builtins(blocks.content)
    assert content == [{"type": "thinking", "thinking": "let me think", "signature": ""},
                       {"type": "text", "text": "Hello"}]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ContentBlockStart", "ContentBlockDelta", "ContentBlockDelta",
                     "ContentBlockStop", "ContentBlockStart", "ContentBlockDelta",
                     "ContentBlockDelta", "ContentBlockStop"]
    message = _sdk_message(events)
    assert [b.to_dict() for b in message.content] == content


def test_tool_call_block_with_parsed_input() -> None:
    tools = functools.partial(HermesParser, tools=frozenset({"get_weather"}))
    blocks, events = _run(_job(tool_parser=tools), [
        "Sure.", "\n<tool_call>\n", '{"name": "get_weather", "arguments": {"city": ',
        '"Paris"}}', "\n</tool_call>\n", "  "])
    content = msgspec.to_builtins(blocks.content)
    assert content[0] == {"type": "text", "text": "Sure."}
    assert content[1]["type"] == "tool_use" and content[1]["name"] == "get_weather"
    assert content[1]["input"] == {"city": "Paris"}
    assert len(content) == 2  # NOTE: the whitespace after the call opens no text block
    assert blocks.stop_reason("stop", None) == "tool_use"
    message = _sdk_message(events)
    sdk = [b.to_dict() for b in message.content]
    assert sdk[1]["input"] == {"city": "Paris"} and sdk[1]["id"] == content[1]["id"]


def test_stop_reasons() -> None:
    blocks = Blocks()
    assert blocks.stop_reason("length", None) == "max_tokens"
    assert blocks.stop_reason("stop", "END") == "stop_sequence"
    assert blocks.stop_reason("stop", None) == "end_turn"
