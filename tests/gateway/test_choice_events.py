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


def _feed(pieces: list[tuple[str, bool]], reason: str, parser=None) -> tuple[ChoiceEvents, list]:
    """Pieces (text, forced by the budget closing); the last one ends with `reason`."""
    maker = parser or functools.partial(HermesParser, tools=frozenset({"f", "g"}))
    ev, out = ChoiceEvents(_job(tool_parser=maker)), []
    for i, (text, forced) in enumerate(pieces):
        last = i == len(pieces) - 1
        out += ev.feed(Piece(text, [7], finish_reason=reason if last else None, forced=forced))
    return ev, out


CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_a_call_is_sent_whole_once_its_object_closes() -> None:
    ev = ChoiceEvents(_job(tool_parser=functools.partial(HermesParser, tools=frozenset({"f"}))))
    assert ev.feed(Piece('<tool_call>\n{"name": "f", "argu', [7])) == []
    assert ev.feed(Piece('ments": {"a": ', [7])) == []
    out = ev.feed(Piece("1}}", [7]))
    assert [type(e) for e in out] == [CallStart, CallArguments]
    assert "".join(e.arguments for e in out[1:]).replace(" ", "") == '{"a":1}'
    assert ev.calls[0][1:] == ("f", '{"a": 1}')


def test_the_call_the_budget_closing_reached_is_dropped_the_ones_before_kept() -> None:
    """A second parallel call cut by max_tokens: the engine closed it (`{"a": ""}`), but its
    arguments are not the model's, so the reply ends on the first call alone."""
    second = '\n<tool_call>\n{"name": "g", "arguments": {"a": "Pa'
    ev, out = _feed([(CALL_F, False), (second, False), ('"}}\n</tool_call>', True), ("", True)],
                    "stop")
    assert [(c.index, c.name) for c in out if isinstance(c, CallStart)] == [(0, "f")]
    assert [c[1] for c in ev.calls] == ["f"] and ev.cut_calls == 1
    assert ev.finish_reason("stop") == "tool_calls"


def test_a_call_wholly_written_by_the_closing_is_dropped() -> None:
    ev, out = _feed([('<tool_call>\n{"name": "f", "arguments": {"a": 0}}\n</tool_call>', True)],
                    "stop")
    assert out == [] and ev.calls == [] and ev.cut_calls == 1
    assert ev.finish_reason("stop") == "length"  # truncated: no call to make


def test_a_forced_end_after_complete_calls_cuts_nothing() -> None:
    ev, out = _feed([(CALL_F, False), ("", True)], "stop")
    assert [c[1] for c in ev.calls] == ["f"] and ev.cut_calls == 0
    assert ev.finish_reason("stop") == "tool_calls"


def test_a_call_open_when_the_budget_ends_is_dropped() -> None:
    """No closing (a grammar-free reply): max_tokens cuts the second call's JSON; the first
    call is the reply's, and the budget ending after it is `tool_calls`."""
    ev, out = _feed([(CALL_F, False), ('\n<tool_call>\n{"name": "g", "arguments": {"a"', False)],
                    "length")
    assert [c[1] for c in ev.calls] == ["f"] and ev.cut_calls == 1
    assert ev.finish_reason("length") == "tool_calls"
    ev, _ = _feed([('<tool_call>\n{"name": "g", "arguments": {"a"', False)], "length")
    assert ev.calls == [] and ev.finish_reason("length") == "length"


def test_calls_after_a_dropped_one_are_renumbered() -> None:
    broken = '\n<tool_call>\n{"name": "g", "arguments": {"a": \n</tool_call>'
    ev, out = _feed([(CALL_F, False), (broken, False), ("\n" + CALL_F, False)], "stop")
    assert [c.index for c in out if isinstance(c, CallStart)] == [0, 1]
    assert [c[1] for c in ev.calls] == ["f", "f"] and ev.cut_calls == 1
