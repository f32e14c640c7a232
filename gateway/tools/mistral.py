"""Mistral tool calls: content, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`
objects (Mistral tokenizers v3 to v7)."""

from __future__ import annotations

import json
import random
import string
from typing import TYPE_CHECKING, Any

from gateway.tools.format import ToolFormat
from gateway.tools.parsing import CallEvent, ObjectsParser, partial_suffix

if TYPE_CHECKING:
    from gateway.tools.format import CallSyntax

MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser(ObjectsParser):
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
                self._held = MISTRAL_TOOL_CALLS
                self._buf = self._buf[start + len(MISTRAL_TOOL_CALLS):]
                self._mode = "array"
            if self._mode == "array":
                head = self._buf.lstrip()
                if not head and not final:
                    return events
                if not head.startswith("["):  # NOTE: not a call array: shown as content
                    self._mode = "content"
                    events.append(CallEvent(content=self._held))
                    self._held = ""
                    continue
                head = head[1:].lstrip()
                if not head and not final:
                    return events
                self._held += self._buf[: len(self._buf) - len(head)]
                self._buf, self._mode = head, "calls"
                if head.startswith("{"):
                    self._new_call()
            done = self._objects(events, final)
            if done is None:
                return events
            if done and self._held:  # NOTE: no object followed the opening: all content
                events.append(CallEvent(content=self._held))
                self._held, done = "", False
            if done:
                rest = self._buf.lstrip()
                self._buf = rest[1:] if rest.startswith("]") else rest
            self._mode, self._held = "content", ""
            if not self._buf:
                return events



class MistralFormat(ToolFormat):
    name = "mistral"
    opening = MISTRAL_TOOL_CALLS
    parser = MistralParser
    example = f'{MISTRAL_TOOL_CALLS} [{{"name": <function-name>, "arguments": <args-dict>}}]'
    wrapping = f"in a JSON list after {MISTRAL_TOOL_CALLS}"

    def detects(self, template: str) -> bool:
        return MISTRAL_TOOL_CALLS in template

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
        return f"{MISTRAL_TOOL_CALLS} {body}"

    def call_properties(self) -> dict[str, Any]:
        # NOTE: Mistral's templates write each past call's 9-character id after its arguments
        return {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}

    def calls_rule(self, parallel: bool, syntax: CallSyntax) -> str:
        return 'calls: " [" body (", " body)* "]"' if parallel else 'calls: " [" body "]"'
