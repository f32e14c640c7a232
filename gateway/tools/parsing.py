"""What the tool-call parsers share: the calls read so far, a streamed JSON object judged a call
once its `name` is one of the request's tools, and runs of such objects (Llama 3, Mistral).
Each format's own parser is in its file (gateway/tools/hermes.py, llama3_json.py, mistral.py)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

_WS = " \t\r\n"


@dataclass
class CallEvent:
    """A parsed piece of a reply: content text, or a call's start (name) / argument fragment."""

    index: int | None = None  # the call's index; None for content
    content: str = ""
    id: str | None = None  # set on a call's first event, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class _Scan:
    """The top level of a JSON object's text so far."""

    bad: bool = False  # the text is no JSON object
    end: int | None = None  # just after its closing brace, once it arrived
    # key -> (where its value begins, where the value's text so far ends, whether it ended);
    # a value is listed once its first character arrived
    values: dict[str, tuple[int, int, bool]] = field(default_factory=dict)


def scan_object(text: str) -> _Scan:
    """Read the keys at depth 1 of the JSON object `text` begins with (after whitespace)."""
    scan, n = _Scan(), len(text)

    def skip(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        return i

    i = skip(0)
    if i == n:
        return scan
    if text[i] != "{":
        return _Scan(bad=True)
    i = skip(i + 1)
    if i < n and text[i] == "}":
        scan.end = i + 1
        return scan
    while True:
        i = skip(i)
        if i == n:
            return scan
        if text[i] != '"':
            return _Scan(bad=True)
        length, closed = json_value_prefix(text[i:])
        if not closed:
            return scan
        try:
            key = json.loads(text[i : i + length])
        except ValueError:
            return _Scan(bad=True)
        i = skip(i + length)
        if i == n:
            return scan
        if text[i] != ":":
            return _Scan(bad=True)
        i = skip(i + 1)
        if i == n:
            return scan  # NOTE: the value has not begun: whitespace may still follow
        length, closed = json_value_prefix(text[i:])
        if length == 0:
            return _Scan(bad=True)
        scan.values[key] = (i, i + length, closed)
        if not closed:
            return scan
        i = skip(i + length)
        if i == n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            return _Scan(bad=True)
        i += 1


@dataclass
class _JsonCall:
    """One object `{"name": ..., <args key>: {...}}` fed as it streams: a call once its
    top-level `name` is one of the request's tools, else (no name, another name, no JSON
    object) not a call, and its text is content."""

    index: int
    id: str
    args_keys: tuple[str, ...]
    tools: frozenset[str] | None  # the request's function names (None: any name)
    text: str = ""
    verdict: str | None = None  # None: not yet known | "call" | "not"
    args_sent: int = 0  # how much of the arguments was sent
    args_done: bool = False
    complete: bool = False  # its object closed (a call cut or broken off never does)

    def add(self, more: str, closed: bool) -> list[CallEvent]:
        """Feed more of the object's text; `closed`: no more of it will come."""
        self.text += more
        scan = scan_object(self.text)
        events: list[CallEvent] = []
        if self.verdict is None:
            name = scan.values.get("name")
            if scan.bad or (name is not None and name[2] and self.text[name[0]] != '"'):
                self.verdict = "not"
                return events
            if name is None or not name[2]:
                if closed or scan.end is not None:
                    self.verdict = "not"
                return events
            called = json.loads(self.text[name[0] : name[1]])
            if self.tools is not None and called not in self.tools:
                self.verdict = "not"
                return events
            self.verdict = "call"
            events.append(CallEvent(self.index, id=self.id, name=called))
        if self.args_done:
            return events
        key = next((k for k in scan.values if k in self.args_keys), None)
        if key is not None:
            start, stop, _ = scan.values[key]
            fragment = self.text[start + self.args_sent : stop]
            self.args_sent = stop - start
            if fragment:
                events.append(CallEvent(self.index, arguments=fragment))
        if closed or scan.end is not None:
            self.args_done, self.complete = True, scan.end is not None
            if key is None:  # NOTE: a call without arguments takes none: "{}", valid JSON
                events.append(CallEvent(self.index, arguments="{}"))
        return events


@dataclass
class CallParser:
    """A format's incremental parser: `feed(text, final)` splits a reply's streamed text into
    content and calls, sending a call's id and name first, then its arguments as they arrive.
    This base holds the calls so far and the events that record them."""

    tools: frozenset[str] | None = None  # the request's function names (None: any name)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    # call index -> whether its object closed, once the call ended (absent while it is open)
    ended: dict[int, bool] = field(default_factory=dict)
    _buf: str = ""
    _call: _JsonCall | None = None
    _held: str = ""  # text read before the open object: content if it is not a call
    _after_call: bool = False  # whitespace right after a call is not content

    ARGS_KEYS: ClassVar[tuple[str, ...]] = ("arguments",)

    def feed(self, text: str, final: bool = False) -> list[CallEvent]:
        """The events of `text`, the reply's next piece; `final`: no more text will come."""
        raise NotImplementedError

    @property
    def named_calls(self) -> list[tuple[str, str, str]]:
        """The calls read (text that only looked like a call is content)."""
        return self.calls

    def _new_call(self) -> _JsonCall:
        self._call = _JsonCall(len(self.calls), self._call_id(), self.ARGS_KEYS, self.tools)
        return self._call

    def _call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _feed_call(self, text: str, closed: bool, events: list[CallEvent]) -> bool:
        """Feed the open object; False when it turned out not to be a call (its text and
        what was held before it are then content, and no object is open)."""
        call = self._call
        assert call is not None
        new = call.add(text, closed)
        if call.verdict == "not":
            events.append(CallEvent(content=self._held + call.text))
            self._held, self._call, self._after_call = "", None, False
            return False
        for e in new:
            if e.name is not None:
                self.calls.append((call.id, e.name, ""))
                self._held = ""
            else:
                call_id, name, args = self.calls[call.index]
                self.calls[call.index] = (call_id, name, args + e.arguments)
            events.append(e)
        if call.verdict == "call" and call.args_done:
            self.ended[call.index] = call.complete
        return True

    def _content(self, text: str, events: list[CallEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            events.append(CallEvent(content=text))


class ObjectsParser(CallParser):
    """Calls as a run of JSON objects joined by a separator (Llama 3, Mistral)."""

    SEPARATOR = ";"

    def _objects(self, events: list[CallEvent], final: bool) -> bool | None:
        """Parse objects from the buffer: True when the run of calls ended, False when an
        object turned out not to be a call (it is content, the run ended); the buffer holds
        what follows. None when more text is needed."""
        while True:
            if self._call is not None:
                length, closed = json_value_prefix(self._call.text + self._buf)
                take = length - len(self._call.text)
                piece, self._buf = self._buf[:take], self._buf[take:]
                if not self._feed_call(piece, closed or final, events):
                    return False
                if not closed:
                    return True if final else None
                self._call, self._after_call = None, True
            rest = self._buf.lstrip()
            if not rest and not final:
                return None
            if rest.startswith(self.SEPARATOR):
                after = rest[len(self.SEPARATOR):].lstrip()
                if not after and not final:
                    return None
                if after.startswith("{"):
                    self._held = self._buf[: len(self._buf) - len(after)]
                    self._buf = after
                    self._new_call()
                    continue
            return True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_value_prefix(text: str) -> tuple[int, bool]:
    """(how much of text belongs to the JSON value it begins with, after any whitespace;
    whether the value ended). A scalar ends at the first character that cannot continue it."""
    depth, in_string, escaped, begun = 0, False, False, False
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
        elif not begun and ch in _WS:
            continue  # NOTE: whitespace before the value is not the end of a scalar
        elif ch == '"':
            in_string, begun = True, True
        elif ch in "{[":
            depth, begun = depth + 1, True
        elif ch in "}]":
            if depth == 0:
                return i, True  # a scalar (or nothing) ended at its container's close
            depth -= 1
            if depth == 0:
                return i + 1, True
        elif depth == 0 and (ch in _WS or ch in ",;:"):
            return i, True  # a scalar ended
        else:
            begun = True
    return len(text), False
