"""Incremental tool-call parsers (`--tool-call-parser`): each splits a reply's streamed text into
content and calls, sending a call's id and name first, then its arguments as they arrive.

Formats (vLLM's names): `hermes` `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` (Qwen2.5,
Hermes, our fallback prompt); `llama3_json` a reply that is `{"name", "parameters"}` objects
joined by `; ` (Llama 3.1/3.2 JSON tool calling); `mistral` `[TOOL_CALLS] [{"name",
"arguments"}, ...]` (Mistral tokenizers v3 to v7).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class CallEvent:
    """A parsed piece of a reply: content text, or a call's start (name) / argument fragment."""

    index: int | None = None  # the call's index; None for content
    content: str = ""
    id: str | None = None  # set on a call's first event, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class _JsonCall:
    """One call's JSON object `{"name": ..., <args key>: {...}}`, fed as it streams."""

    index: int
    id: str
    args_keys: str  # regex alternatives of the arguments' key
    text: str = ""
    started: bool = False  # its id and name were sent
    args_start: int | None = None  # where the arguments' value begins in text
    args_sent: int = 0  # how much of the arguments was sent
    args_closed: bool = False

    def add(self, more: str) -> list[CallEvent]:
        self.text += more
        events: list[CallEvent] = []
        if not self.started:
            m = _NAME.search(self.text)
            if m is None:
                return events
            self.started = True
            events.append(CallEvent(self.index, id=self.id, name=json.loads(f'"{m.group(1)}"')))
        if self.args_start is None:
            m = re.search(rf'"(?:{self.args_keys})"\s*:\s*', self.text)
            if m is None:
                return events
            self.args_start = m.end()
        if not self.args_closed:
            value = self.text[self.args_start:]
            length, self.args_closed = json_value_prefix(value)
            fragment = value[self.args_sent:length]
            self.args_sent = length
            if fragment:
                events.append(CallEvent(self.index, arguments=fragment))
        return events


@dataclass
class _Parser:
    """What the three parsers share: the calls so far and the events that record them."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    _buf: str = ""
    _call: _JsonCall | None = None
    _after_call: bool = False  # whitespace right after a call is not content

    ARGS_KEYS = "arguments"

    @property
    def named_calls(self) -> list[tuple[str, str, str]]:
        """The calls whose name was read (text that only looked like a call has none)."""
        return [c for c in self.calls if c[1]]

    def _new_call(self) -> _JsonCall:
        self._call = _JsonCall(len(self.calls), self._call_id(), self.ARGS_KEYS)
        self.calls.append((self._call.id, "", ""))
        return self._call

    def _call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _feed_call(self, text: str, events: list[CallEvent]) -> None:
        call = self._call
        assert call is not None
        for e in call.add(text):
            call_id, name, args = self.calls[call.index]
            self.calls[call.index] = (call_id, e.name or name, args + e.arguments)
            events.append(e)

    def _content(self, text: str, events: list[CallEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            events.append(CallEvent(content=text))


class HermesParser(_Parser):
    """`<tool_call>` JSON `</tool_call>` calls anywhere in the text."""

    def feed(self, text: str, final: bool = False) -> list[CallEvent]:
        self._buf += text
        events: list[CallEvent] = []
        while True:
            if self._call is None:
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else partial_suffix(self._buf, TOOL_CALL_START)
                    cut = len(self._buf) - keep
                    self._content(self._buf[:cut], events)
                    self._buf = self._buf[cut:]
                    return events
                self._content(self._buf[:start], events)
                self._after_call = True
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._new_call()
                continue
            end = self._buf.find(TOOL_CALL_END)
            keep = 0 if end >= 0 or final else partial_suffix(self._buf, TOOL_CALL_END)
            body = self._buf[:end] if end >= 0 else self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(body):]
            self._feed_call(body, events)
            if end < 0:
                return events
            self._buf = self._buf[len(TOOL_CALL_END):]
            self._call = None


class _ObjectsParser(_Parser):
    """Calls as a run of JSON objects joined by a separator (Llama 3, Mistral)."""

    SEPARATOR = ";"

    def _objects(self, events: list[CallEvent], final: bool) -> bool | None:
        """Parse objects from the buffer: True when the run ended (the buffer holds what
        follows it), None when more text is needed."""
        while True:
            if self._call is not None:
                length, closed = json_value_prefix(self._call.text + self._buf)
                take = length - len(self._call.text)
                self._feed_call(self._buf[:take], events)
                self._buf = self._buf[take:]
                if not closed:
                    return True if final else None
                self._call = None
            rest = self._buf.lstrip()
            if not rest and not final:
                return None
            if rest.startswith(self.SEPARATOR):
                after = rest[len(self.SEPARATOR):].lstrip()
                if not after and not final:
                    return None
                if after.startswith("{"):
                    self._buf = after
                    self._new_call()
                    continue
            return True


class Llama3JsonParser(_ObjectsParser):
    """A reply that begins (after `<|python_tag|>` and spaces) with `{` is calls
    `{"name", "parameters"}` joined by `; `; any other reply is content."""

    ARGS_KEYS = "parameters|arguments"
    _mode: str = "start"  # start | calls | content

    def feed(self, text: str, final: bool = False) -> list[CallEvent]:
        self._buf += text
        events: list[CallEvent] = []
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return events  # NOTE: not yet known whether this reply is a call
            if head.startswith("{"):
                self._mode, self._buf = "calls", head
                self._new_call()
            else:
                self._mode = "content"
        if self._mode == "calls" and self._objects(events, final):
            self._mode, self._after_call = "content", True
        if self._mode == "content":
            self._content(self._buf, events)
            self._buf = ""
        return events


class MistralParser(_ObjectsParser):
    """Content, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}` objects."""

    SEPARATOR = ","
    _mode: str = "content"  # content | array | calls

    def _call_id(self) -> str:
        # NOTE: Mistral's templates take only 9-character alphanumeric call ids
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def feed(self, text: str, final: bool = False) -> list[CallEvent]:
        self._buf += text
        events: list[CallEvent] = []
        while True:
            if self._mode == "content":
                start = self._buf.find(MISTRAL_TOOL_CALLS)
                if start < 0:
                    keep = 0 if final else partial_suffix(self._buf, MISTRAL_TOOL_CALLS)
                    cut = len(self._buf) - keep
                    self._content(self._buf[:cut], events)
                    self._buf = self._buf[cut:]
                    return events
                self._content(self._buf[:start], events)
                self._buf = self._buf[start + len(MISTRAL_TOOL_CALLS):]
                self._mode = "array"
            if self._mode == "array":
                head = self._buf.lstrip()
                if not head and not final:
                    return events
                if not head.startswith("["):  # NOTE: not a call array: shown as content
                    self._mode = "content"
                    self._content(MISTRAL_TOOL_CALLS, events)
                    continue
                head = head[1:].lstrip()
                if not head and not final:
                    return events
                self._buf, self._mode = head, "calls"
                if head.startswith("{"):
                    self._new_call()
            done = self._objects(events, final)
            if done is None:
                return events
            rest = self._buf.lstrip()
            self._buf = rest[1:] if rest.startswith("]") else rest
            self._mode, self._after_call = "content", True
            if not self._buf:
                return events


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_value_prefix(text: str) -> tuple[int, bool]:
    """(how much of text belongs to the JSON value it begins with, whether the value ended)."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1, True
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1, True
        elif depth == 0 and ch in ",;\n" and i > 0:
            return i, True  # a scalar ended
    return len(text), False


PARSER_CLASSES: dict[str, type[_Parser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
