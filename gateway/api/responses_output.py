"""A Response's output items and stream events, written from one choice's `ChoiceEvents`:
`reasoning` items, `message` items of `output_text`, `function_call` items; the same writer
builds the JSON reply (events unused) and the SSE stream."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gateway.api.responses_types import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesUsage,
)
from gateway.choice_events import (
    CallArguments,
    CallStart,
    ChoiceEvent,
    ChoiceEvents,
    ReasoningDelta,
    TextDelta,
)
from gateway.generation import Generation, Piece
from ipc.messages import FINISH_ABORT, FINISH_LENGTH

_encoder = msgspec.json.Encoder()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Turns a Generation's pieces into `response.output` (and, with `stream`, the SSE events
    in order, each numbered by `sequence_number`). Exactly one of `finish` / `fail` ends it."""

    def __init__(self, gen: Generation, response: ResponseObject, stream: bool) -> None:
        self.response = response
        self._gen = gen
        self._events = ChoiceEvents(gen.job)
        self._stream = stream
        self._out: list[bytes] = []
        self._seq = 0
        self._open: OutputItem | None = None
        self._blank = ""  # whitespace held back until it is known to belong to a message

    def start(self) -> list[bytes]:
        self._emit("response.created", response=self.response)
        self._emit("response.in_progress", response=self.response)
        return self._flush()

    def feed(self, piece: Piece) -> list[bytes]:
        for event in self._events.feed(piece):
            self._on(event)
        return self._flush()

    def finish(self, reason: str | None) -> list[bytes]:
        """Close the open item and end with response.completed / .incomplete / .failed."""
        reason = self._events.finish_reason(reason)
        if not self.response.output:
            self._text(self._blank)  # NOTE: a reply of only whitespace (or none) is a message
        incomplete = reason == FINISH_LENGTH
        self._close("incomplete" if incomplete else "completed")
        r = self.response
        r.usage = self._usage()
        if reason == FINISH_ABORT:
            r.status, r.error = "cancelled", ResponseError("cancelled", "the request was aborted")
            self._emit("response.failed", response=r)
        elif incomplete:
            r.status, r.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
            self._emit("response.incomplete", response=r)
        else:
            r.status = "completed"
            self._emit("response.completed", response=r)
        return self._flush()

    def fail(self, message: str) -> list[bytes]:
        self._close("incomplete")
        r = self.response
        r.status, r.error, r.usage = "failed", ResponseError("server_error", message), self._usage()
        self._emit("response.failed", response=r)
        return self._flush()

    def _usage(self) -> ResponsesUsage:
        u = self._gen.usage
        return ResponsesUsage(u["prompt_tokens"], InputTokensDetails(u["cached_tokens"]),
                              u["completion_tokens"],
                              OutputTokensDetails(self._events.reasoning_tokens),
                              u["prompt_tokens"] + u["completion_tokens"])

    # ---- events -> items ---------------------------------------------------------------

    def _on(self, event: ChoiceEvent) -> None:
        match event:
            case ReasoningDelta(text):
                self._reasoning(text)
            case TextDelta(text):
                if isinstance(self._open, MessageItem):
                    self._text(text)
                elif text.strip():
                    self._text(self._blank + text)
                    self._blank = ""
                else:
                    self._blank += text
            case CallStart(_, call_id, name):
                self._blank = ""  # NOTE: whitespace around calls is not a message
                self._open_item(FunctionCallItem(_id("fc"), call_id, name, ""))
            case CallArguments(_, arguments):
                item = self._open
                assert isinstance(item, FunctionCallItem)
                item.arguments += arguments
                self._emit("response.function_call_arguments.delta", item_id=item.id,
                           output_index=len(self.response.output) - 1, delta=arguments)

    def _reasoning(self, text: str) -> None:
        if not isinstance(self._open, ReasoningItem):
            self._open_item(ReasoningItem(_id("rs"), []))
            self._part_added(ReasoningText(""))
        item = self._open
        assert isinstance(item, ReasoningItem)
        item.content[0].text += text
        self._emit("response.reasoning_text.delta", item_id=item.id,
                   output_index=len(self.response.output) - 1, content_index=0, delta=text)

    def _text(self, text: str) -> None:
        if not isinstance(self._open, MessageItem):
            self._open_item(MessageItem(_id("msg"), []))
            self._part_added(OutputText(""))
        item = self._open
        assert isinstance(item, MessageItem)
        if not text:
            return
        item.content[0].text += text
        self._emit("response.output_text.delta", item_id=item.id,
                   output_index=len(self.response.output) - 1, content_index=0, delta=text,
                   logprobs=[])

    def _open_item(self, item: OutputItem) -> None:
        self._close("completed")
        self.response.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.response.output) - 1,
                   item=item)

    def _part_added(self, part: OutputText | ReasoningText) -> None:
        item = self._open
        assert isinstance(item, MessageItem | ReasoningItem)
        item.content.append(part)  # type: ignore[arg-type]
        self._emit("response.content_part.added", item_id=item.id,
                   output_index=len(self.response.output) - 1, content_index=0, part=part)

    def _close(self, status: str) -> None:
        """The open item's closing events (its text or arguments whole), then output_item.done."""
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.response.output) - 1
        if isinstance(item, FunctionCallItem):
            self._emit("response.function_call_arguments.done", item_id=item.id,
                       output_index=index, arguments=item.arguments)
        else:
            part = item.content[0]
            kind = "output_text" if isinstance(item, MessageItem) else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if isinstance(item, MessageItem) else {}
            self._emit(f"response.{kind}.done", item_id=item.id, output_index=index,
                       content_index=0, text=part.text, **extra)
            self._emit("response.content_part.done", item_id=item.id, output_index=index,
                       content_index=0, part=part)
        item.status = status  # type: ignore[assignment]
        self._emit("response.output_item.done", output_index=index, item=item)

    # ---- SSE ---------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> None:
        """One event, encoded now (the items it shows change later); nothing unless streaming."""
        if self._stream:
            data = _encoder.encode({"type": kind, "sequence_number": self._seq, **fields})
            self._out.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")
        self._seq += 1

    def _flush(self) -> list[bytes]:
        out, self._out = self._out, []
        return out
