"""Hermes tool calls: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` anywhere in the reply
(Qwen2.5, Hermes, and our fallback prompt)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.tools.format import ToolFormat
from gateway.tools.parsing import CallEvent, CallParser, partial_suffix

if TYPE_CHECKING:
    from gateway.tools.format import CallSyntax

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class HermesParser(CallParser):
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
                self._held = TOOL_CALL_START
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._new_call()
                continue
            end = self._buf.find(TOOL_CALL_END)
            keep = 0 if end >= 0 or final else partial_suffix(self._buf, TOOL_CALL_END)
            body = self._buf[:end] if end >= 0 else self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(body):]
            if not self._feed_call(body, end >= 0 or final, events):
                continue  # NOTE: not a call: the rest (its closing tag too) is content
            if end < 0:
                return events
            self._buf = self._buf[len(TOOL_CALL_END):]
            self._call, self._after_call = None, True



class HermesFormat(ToolFormat):
    name = "hermes"
    opening, closing = TOOL_CALL_START, TOOL_CALL_END
    parser = HermesParser
    example = (f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-dict>}}\n'
               f"{TOOL_CALL_END}")
    wrapping = f"within {TOOL_CALL_START}{TOOL_CALL_END} XML tags"
    joins_calls = False

    def detects(self, template: str) -> bool:
        return TOOL_CALL_START in template

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{TOOL_CALL_START}\n" + json.dumps({"name": n, "arguments": a},
                                                             ensure_ascii=False)
                         + f"\n{TOOL_CALL_END}" for n, a in calls)

    def calls_rule(self, parallel: bool, syntax: CallSyntax) -> str:
        close = (f'"\\n" {syntax.special_closing}' if syntax.special_closing
                 else json.dumps(f"\n{TOOL_CALL_END}"))
        one = f'"\\n" body {close}'
        return f'calls: {one} ("\\n" {syntax.opening} {one})*' if parallel else f"calls: {one}"
