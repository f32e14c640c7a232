"""One choice's reply as typed events: reasoning, answer text and tool calls, split once.

Every API's output shape (chat chunks and messages, Responses items, Anthropic content blocks)
is written from these events, so a reply is parsed the same way on every route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.generation import Job, Piece
from ipc.messages import FINISH_STOP


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
    has one), then the tool-call parser on the answer (when the request has tools)."""

    def __init__(self, job: Job) -> None:
        self._reasoning: ReasoningParser | None = _make(job.reasoning_parser)
        self._tools: Any = _make(job.tool_parser)
        self.reasoning_tokens = 0

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
        for e in self._tools.feed(text, final=final):
            if e.index is None:
                if e.content:
                    events.append(TextDelta(e.content))
            elif e.name is not None:
                events.append(CallStart(e.index, e.id, e.name))
            elif e.arguments:
                events.append(CallArguments(e.index, e.arguments))
        return events

    @property
    def calls(self) -> list[tuple[str, str, str]]:
        """The tool calls read so far: (id, name, arguments)."""
        return list(self._tools.named_calls) if self._tools is not None else []

    def finish_reason(self, reason: str | None) -> str | None:
        """The client's finish_reason: a stop after tool calls is `tool_calls`."""
        if reason == FINISH_STOP and self.calls:
            return "tool_calls"
        return reason


def _make(maker: Callable[[], Any] | None) -> Any:
    return maker() if maker is not None else None
