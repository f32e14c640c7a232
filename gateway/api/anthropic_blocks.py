"""One reply's ChoiceEvents as Anthropic content blocks (thinking, text, tool_use), and the
stream events that open, fill and close each block: the JSON reply and the SSE stream are
written by the same `Blocks`, so both show the same content."""

from __future__ import annotations

import json
from typing import Any

from gateway.api.anthropic_types import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    OutBlock,
    OutText,
    OutThinking,
    OutToolUse,
    StopReason,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
)
from gateway.choice_events import CallArguments, CallStart, ChoiceEvent, ReasoningDelta
from gateway.choice_events import TextDelta as AnswerDelta
from ipc.messages import FINISH_LENGTH, FINISH_STOP


class Blocks:
    """Feed events in order; `content` is the reply's blocks so far. A block opens at the
    first event of another kind (a tool call always opens its own); a text block's trailing
    whitespace is dropped, as Anthropic's replies have none."""

    def __init__(self) -> None:
        self.content: list[OutBlock] = []
        self._open: OutBlock | None = None
        self._args: dict[int, str] = {}  # call index -> its arguments' JSON text
        self._call_block: dict[int, int] = {}  # call index -> its block's index
        self._held = ""  # whitespace that opens no block unless text follows

    @property
    def has_calls(self) -> bool:
        return bool(self._call_block)

    def feed(self, events: list[ChoiceEvent]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                block = self._block(OutThinking, out)
                assert isinstance(block, OutThinking)
                block.thinking += e.text
                out.append(ContentBlockDelta(len(self.content) - 1, ThinkingDelta(e.text)))
            elif isinstance(e, AnswerDelta):
                self._text(e.text, out)
            elif isinstance(e, CallStart):
                self._close(out)
                self._open_block(OutToolUse(e.id, e.name, {}), out)
                self._call_block[e.index], self._args[e.index] = len(self.content) - 1, ""
            elif isinstance(e, CallArguments):
                self._args[e.index] += e.arguments
                out.append(ContentBlockDelta(self._call_block[e.index],
                                             InputJsonDelta(e.arguments)))
        return out

    def finish(self) -> list[StreamEvent]:
        """Close the open block (the reply ended)."""
        out: list[StreamEvent] = []
        self._close(out)
        return out

    def stop_reason(self, finish_reason: str | None, stop_string: str | None) -> StopReason:
        """Of ChoiceEvents.finish_reason's answer (`tool_calls`: the reply ended on calls)."""
        if finish_reason == FINISH_LENGTH:
            return "max_tokens"
        if finish_reason == "tool_calls" or (finish_reason == FINISH_STOP and self.has_calls):
            return "tool_use"
        return "stop_sequence" if stop_string is not None else "end_turn"

    def _text(self, text: str, out: list[StreamEvent]) -> None:
        # NOTE: whitespace is held until text follows it: a block neither ends in whitespace
        # (as before a tool call) nor opens on whitespace alone (as after one)
        text, self._held = self._held + text, ""
        body = text.rstrip()
        self._held = text[len(body):]
        if not body:
            return
        block = self._block(OutText, out)
        assert isinstance(block, OutText)
        block.text += body
        out.append(ContentBlockDelta(len(self.content) - 1, TextDelta(body)))

    def _block(self, kind: type, out: list[StreamEvent]) -> OutBlock:
        if not isinstance(self._open, kind):
            self._close(out)
            self._open_block(kind(""), out)
        assert self._open is not None
        return self._open

    def _open_block(self, block: OutBlock, out: list[StreamEvent]) -> None:
        # NOTE: the start event gets its own (empty) copy: the open block grows in place
        start = OutToolUse(block.id, block.name, {}) if isinstance(block, OutToolUse) \
            else type(block)("")
        out.append(ContentBlockStart(len(self.content), start))
        self.content.append(block)
        self._open = block

    def _close(self, out: list[StreamEvent]) -> None:
        self._held = ""
        block = self._open
        if block is None:
            return
        if isinstance(block, OutToolUse):
            index = next(i for i, b in self._call_block.items() if self.content[b] is block)
            block.input = _input(self._args[index])
        out.append(ContentBlockStop(len(self.content) - 1))
        self._open = None


def _input(arguments: str) -> dict[str, Any]:
    """A call's input. NOTE: arguments that are no JSON object are a call that max_tokens cut
    short (stop_reason `max_tokens` says so): its input is then empty, as the SDK's partial
    parse of the streamed fragments would have it only in part."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
