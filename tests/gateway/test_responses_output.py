"""The Responses writer and store without a server: every streamed event and the final
response validated by openai-python's own pydantic types (strictly, not as its stream parses
them), reasoning items from a reasoning parser, tool calls, and the store's byte and age bounds."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.api.response_store import ResponseStore
from gateway.api.responses_output import ResponseWriter
from gateway.api.responses_types import ResponseObject
from gateway.generation import Job, Piece
from gateway.requests import ChatMessage
from gateway.tools.hermes import HermesParser
from ipc.sampling import SamplingParams

# event type -> openai-python's model of it
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls
          for cls in get_args(get_args(ResponseStreamEvent)[0])}


class _Think:
    """A reasoning parser for the test: text before `</think>` is reasoning (held back while it
    may be the marker's start)."""

    def __init__(self) -> None:
        self.held = ""
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        if self.done:
            return "", text
        text = self.held + text
        head, sep, tail = text.partition("</think>")
        if sep:
            self.done, self.held = True, ""
            return head, tail
        keep = next((k for k in range(len("</think>") - 1, 0, -1)
                     if not final and text.endswith("</think>"[:k])), 0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def count(self, token_ids: list[int]) -> int:
        return 0 if self.done else len(token_ids)


@dataclass
class _Gen:
    job: Job
    usage: dict[str, int] = field(default_factory=lambda: {
        "prompt_tokens": 5, "completion_tokens": 9, "cached_tokens": 2})


def _run(job: Job, texts: list[str], reason: str = "stop") -> tuple[list[dict], Response]:
    gen = _Gen(job)
    writer = ResponseWriter(gen, ResponseObject(id="resp_1", created_at=1, model="m"), True)  # type: ignore[arg-type]
    raw = writer.start()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        raw += writer.feed(Piece(text, [7], finish_reason=reason if last else None))
    raw += writer.finish(reason)
    events = []
    for frame in raw:
        head, data = frame.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        EVENTS[event["type"]].model_validate(event)  # NOTE: every required field and literal
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    return events, final


def _job(**kw) -> Job:
    return Job("resp_1", "chat", "m", [1], SamplingParams(max_tokens=8), **kw)


THOUGHT = "a b</think>Hi there"


@pytest.mark.parametrize("cut", range(1, len(THOUGHT)))
def test_reasoning_then_answer_at_every_split(cut: int) -> None:
    text = THOUGHT
    events, final = _run(_job(reasoning_parser=_Think), [text[:cut], text[cut:]])
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, answer) == ("a b", "Hi there")
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "a b"
    assert final.output_text == "Hi there"
    # the first piece's token was reasoning when it ended before the marker did
    assert final.usage.output_tokens_details.reasoning_tokens == int(cut < len("a b</think>"))


def test_tool_call_items_and_whitespace_between_calls() -> None:
    job = _job(tool_parser=functools.partial(HermesParser, tools=frozenset({"f"})))
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    events, final = _run(job, ["\n", call[:15], call[15:], "\n", call])
    assert [o.type for o in final.output] == ["function_call", "function_call"]
    assert all(json.loads(o.arguments) == {"a": 1} and o.name == "f" for o in final.output)
    assert final.output[0].call_id != final.output[1].call_id
    done = [e["arguments"] for e in events
            if e["type"] == "response.function_call_arguments.done"]
    assert done == [o.arguments for o in final.output]
    assert final.status == "completed" and final.usage.total_tokens == 14


def test_length_is_incomplete_with_the_reason() -> None:
    events, final = _run(_job(), ["Hel", "lo"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"


def test_an_empty_reply_is_one_empty_message() -> None:
    events, final = _run(_job(), [""])
    assert [o.type for o in final.output] == ["message"] and final.output_text == ""
    assert "response.output_text.delta" not in [e["type"] for e in events]


def test_store_bounds_bytes_and_age() -> None:
    now = [0.0]
    convo = [ChatMessage("user", "hi")]
    size = 100 + len(json.dumps([{"role": "user", "content": "hi", "name": None,
                                  "tool_calls": None, "tool_call_id": None}],
                                separators=(",", ":")))
    store = ResponseStore(max_bytes=size * 5 // 2, max_age=10, clock=lambda: now[0])
    assert store.put("a", b"x" * 100, convo) and store.put("b", b"y" * 100, convo)
    assert store.bytes == 2 * size
    assert store.put("c", b"z" * 100, convo)  # a third is over the budget: the oldest goes
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    assert not store.put("huge", b"h" * 3 * size, convo) and store.get("huge") is None
    now[0] = 11
    assert store.get("b") is None and store.get("c") is None and store.bytes == 0
    assert store.put("d", b"1", convo) and store.delete("d") and not store.delete("d")
