"""ChoiceEvents: a reply's pieces as reasoning, answer and tool-call events."""

from __future__ import annotations

import functools

from gateway.choice_events import CallArguments, CallStart, ChoiceEvents, ReasoningDelta, TextDelta
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


def _job(**kw) -> Job:
    return Job("r", "chat", "m", [1], SamplingParams(max_tokens=8), **kw)


def _events(job: Job, texts: list[str]) -> tuple[ChoiceEvents, list]:
    ev = ChoiceEvents(job)
    out = []
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        out += ev.feed(Piece(t, [7] * len(t), finish_reason="stop" if last else None))
    return ev, out


def test_plain_text_is_answer() -> None:
    ev, out = _events(_job(), ["Hel", "lo"])
    assert out == [TextDelta("Hel"), TextDelta("lo")]
    assert ev.calls == [] and ev.finish_reason("stop") == "stop"


def test_reasoning_then_tool_call() -> None:
    job = _job(reasoning_parser=_Marker,
               tool_parser=functools.partial(HermesParser, tools=frozenset({"f"})))
    ev, out = _events(job, ["thi", "nk|<tool_call>", '{"name": "f", "arguments": {"a": 1}}',
                            "</tool_call>"])
    assert [e for e in out if isinstance(e, ReasoningDelta)] == [ReasoningDelta("thi"),
                                                                  ReasoningDelta("nk")]
    starts = [e for e in out if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "f")]
    args = "".join(e.arguments for e in out if isinstance(e, CallArguments))
    assert args.replace(" ", "") == '{"a":1}'
    assert not [e for e in out if isinstance(e, TextDelta)]
    assert ev.reasoning_tokens == 3  # the piece that ended the reasoning counts as answer here
    assert ev.finish_reason("stop") == "tool_calls"
