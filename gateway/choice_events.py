"""One choice's reply as typed events: reasoning, answer text and tool calls, split once.

Every API's output shape (chat chunks and messages, Responses items, Anthropic content blocks)
is written from these events, so a reply is parsed the same way on every route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.generation import Job, Piece
from ipc.messages import FINISH_LENGTH, FINISH_STOP


@dataclass(frozen=True)
class TextDelta:
    """Answer text (what chat calls `content`)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's reasoning, before its answer (`reasoning_content`)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index among the reply's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call `index`'s arguments (JSON text; the fragments concatenate)."""

    index: int
    arguments: str


ChoiceEvent = TextDelta | ReasoningDelta | CallStart | CallArguments


class ReasoningParser(Protocol):
    """Splits a reply's text into reasoning and answer as it streams (gateway/reasoning/)."""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of `text`, holding back what may be a marker's start until
        more text (or `final`) decides it."""
        ...

    def count(self, token_ids: list[int]) -> int:
        """How many of these newest tokens (those behind the last `feed`) were reasoning."""
        ...


class ChoiceEvents:
    """Turns one choice's pieces into events: the reasoning parser first (when the request
    has one), then the tool-call parser on the answer (when the request has tools).

    A tool call's events are held until its JSON object closes, then sent together (and
    renumbered among the calls sent): a call that never closes, or that the budget closing
    reached (a piece with `forced`: the engine completed what the model began, so the
    arguments are not the model's), is dropped, so no API returns a cut call as callable.
    """

    def __init__(self, job: Job) -> None:
        self._reasoning: ReasoningParser | None = _make(job.reasoning_parser)
        self._tools: Any = _make(job.tool_parser)
        self.reasoning_tokens = 0
        self._held: list[CallStart | CallArguments] = []  # the open call's events
        self._held_index: int | None = None  # the parser's index of the open call
        self._held_cut = False  # the budget closing reached the open call
        self._forced = False  # the budget closing began: every call from now on is cut
        self._kept: list[int] = []  # the parser's indexes of the calls sent, in order
        self.cut_calls = 0  # calls dropped: cut by the budget or never closed

    def feed(self, piece: Piece) -> list[ChoiceEvent]:
        final = piece.finish_reason is not None
        events: list[ChoiceEvent] = []
        text = piece.text
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text, final)
            self.reasoning_tokens += self._reasoning.count(piece.token_ids)
            if reasoning:
                events.append(ReasoningDelta(reasoning))
        if self._tools is None:
            if text:
                events.append(TextDelta(text))
            return events
        if piece.forced:
            self._forced = self._held_cut = True
        for e in self._tools.feed(text, final=final):
            if e.index is None:
                self._settle(events, ended=True)
                if e.content:
                    events.append(TextDelta(e.content))
                continue
            if e.index != self._held_index:
                self._settle(events, ended=True)
                self._held_index, self._held_cut = e.index, self._forced
            if e.name is not None:
                self._held.append(CallStart(e.index, e.id or "", e.name))
            elif e.arguments:
                self._held.append(CallArguments(e.index, e.arguments))
        self._settle(events, ended=final)
        return events

    def _settle(self, events: list[ChoiceEvent], ended: bool) -> None:
        """Send the held call once its object closed, or drop it once it cannot (it ended
        unclosed, the reply ended, or the budget closing reached it)."""
        index = self._held_index
        if index is None:
            return
        closed = self._tools.ended.get(index)
        if closed is None and not ended:
            return  # still open
        if closed and not self._held_cut:
            sent = len(self._kept)
            self._kept.append(index)
            start = self._held[0]
            assert isinstance(start, CallStart)
            arguments = "".join(e.arguments for e in self._held if isinstance(e, CallArguments))
            events += [CallStart(sent, start.id, start.name), CallArguments(sent, arguments)]
        else:
            self.cut_calls += 1
        self._held, self._held_index, self._held_cut = [], None, False

    @property
    def calls(self) -> list[tuple[str, str, str]]:
        """The tool calls sent so far: (id, name, arguments)."""
        if self._tools is None:
            return []
        named = self._tools.named_calls
        return [named[i] for i in self._kept]

    def finish_reason(self, reason: str | None) -> str | None:
        """The client's finish_reason: a reply that ends on complete tool calls is
        `tool_calls` (a stop, or a budget that ran out after them); one whose every call was
        cut is `length`."""
        if reason not in (FINISH_STOP, FINISH_LENGTH):
            return reason
        if self.calls:
            return "tool_calls"
        return FINISH_LENGTH if self.cut_calls else reason


def _make(maker: Callable[[], Any] | None) -> Any:
    return maker() if maker is not None else None
