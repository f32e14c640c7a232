"""Llama 3 JSON tool calls: a reply that is `{"name", "parameters"}` objects joined by `; `,
perhaps after `<|python_tag|>` (Llama 3.1/3.2 JSON tool calling)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.tools.format import ToolFormat
from gateway.tools.parsing import CallEvent, ObjectsParser

if TYPE_CHECKING:
    from gateway.tools.format import CallSyntax

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ObjectsParser):
    """A reply that begins (after `<|python_tag|>` and spaces) with `{` is calls
    `{"name", "parameters"}` joined by `; `; any other reply, or an object that is no call of
    the request's tools, is content."""

    ARGS_KEYS = ("parameters", "arguments")
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
                self._held = self._buf[: len(self._buf) - len(head)]
                self._mode, self._buf = "calls", head
                self._new_call()
            else:
                self._mode = "content"
        if self._mode == "calls" and self._objects(events, final) is not None:
            self._mode = "content"
        if self._mode == "content":
            self._content(self._buf, events)
            self._buf = ""
        return events



class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    opening = None  # NOTE: no opening: a reply is calls when it begins with `{`
    args_key = "parameters"
    parser = Llama3JsonParser
    example = '{"name": <function-name>, "parameters": <args-dict>}'
    wrapping = "as your whole reply (several calls joined by '; ')"

    def detects(self, template: str) -> bool:
        return PYTHON_TAG in template or '"parameters"' in template

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)

    def calls_rule(self, parallel: bool, syntax: CallSyntax) -> str:
        return 'calls: body ("; " body)*' if parallel else "calls: body"

    def forced_start(self, syntax: CallSyntax) -> str:
        return "start: calls"

    def auto_grammar(self, rules: str, parallel: bool, syntax: CallSyntax) -> str:
        # NOTE: text that begins (after spaces) with anything but `{` is plain text
        return ("%llguidance {}\nstart: PLAIN | LEAD? calls\n"
                "PLAIN: /\\s*([^\\s{](.|\\n)*)?/\nLEAD: /\\s+/\n" + rules)
