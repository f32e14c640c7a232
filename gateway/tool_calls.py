"""Tool calls in the prompt and in the reply: tools and past calls rendered by the chat template
(its tools branch, or a Hermes-style system block when it has none), and an incremental parser
(`--tool-call-parser hermes`) that splits the model's text into content and calls."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.protocol import ChatCompletionRequest
from gateway.structured import TOOL_CALL_END, TOOL_CALL_START

PARSERS = ("auto", "hermes")
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def fallback_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system block for templates without a tools branch (Hermes / NousResearch style)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions. Here are the available tools: <tools>\n{listing}\n</tools>\n"
            "For each function call return a json object with function name and arguments "
            f"within {TOOL_CALL_START}{TOOL_CALL_END} XML tags as follows:\n"
            f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-dict>}}\n'
            f"{TOOL_CALL_END}")


def template_messages(request: ChatCompletionRequest, messages: list[dict[str, Any]],
                      tools_branch: bool) -> tuple[list[dict[str, Any]], list | None]:
    """(messages, tools) for the chat template: past calls and tool results in the shape HF
    templates read, or folded into Hermes-style text when the template has no tools branch."""
    tools = [msgspec.to_builtins(t) for t in request.tools] if request.tools else None
    for out, msg in zip(messages, request.messages, strict=True):
        if msg.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments(c.function.arguments)}}
                                 for c in msg.tool_calls]
        if msg.tool_call_id is not None:
            out["tool_call_id"] = msg.tool_call_id
    if tools_branch:
        return messages, tools
    for out in messages:
        calls = out.pop("tool_calls", None)
        if calls:
            text = "\n".join(f"{TOOL_CALL_START}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False) + f"\n{TOOL_CALL_END}" for c in calls)
            out["content"] = f"{out['content']}\n{text}" if out["content"] else text
        if out["role"] == "tool":
            out.pop("tool_call_id", None)
            out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    if tools and request.tool_choice != "none":
        block = fallback_tools_prompt(tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "role": "system",
                           "content": f"{messages[0]['content']}\n\n{block}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class CallEvent:
    """A parsed piece of a reply: content text, or a call's start (name) / argument fragment."""

    index: int | None = None  # the call's index; None for content
    content: str = ""
    id: str | None = None  # set on a call's first event, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class _Call:
    index: int
    text: str = ""  # the call's body so far (between the tags)
    started: bool = False  # its name was sent
    args_start: int | None = None  # where the arguments' JSON begins in text
    args_sent: int = 0  # how much of the arguments was sent
    closed: bool = False  # the arguments' value is complete


@dataclass
class HermesParser:
    """Splits streamed text into content and `<tool_call>{"name", "arguments"}</tool_call>`
    calls, sending each call's name first, then its arguments as they arrive."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    _buf: str = ""
    _call: _Call | None = None
    _after_call: bool = False  # whitespace right after a call is not content

    def feed(self, text: str, final: bool = False) -> list[CallEvent]:
        self._buf += text
        events: list[CallEvent] = []
        while True:
            if self._call is None:
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._buf, TOOL_CALL_START)
                    cut = len(self._buf) - keep
                    self._content(self._buf[:cut], events)
                    self._buf = self._buf[cut:]
                    return events
                self._content(self._buf[:start], events)
                self._after_call = True
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._call = _Call(len(self.calls))
                self.calls.append(("", "", ""))
                continue
            end = self._buf.find(TOOL_CALL_END)
            keep = 0 if end >= 0 or final else _partial_suffix(self._buf, TOOL_CALL_END)
            body = self._buf[:end] if end >= 0 else self._buf[: len(self._buf) - keep]
            self._call.text += body
            self._buf = self._buf[len(body):]
            events += self._advance(self._call)
            if end < 0:
                return events
            self._buf = self._buf[len(TOOL_CALL_END):]
            self._call = None

    def _content(self, text: str, events: list[CallEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            events.append(CallEvent(content=text))

    def _advance(self, call: _Call) -> list[CallEvent]:
        events = []
        call_id, name, args = self.calls[call.index]
        if not call.started:
            m = _NAME.search(call.text)
            if m is None:
                return events
            call_id, name = f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{m.group(1)}"')
            call.started = True
            events.append(CallEvent(call.index, id=call_id, name=name))
        if call.args_start is None:
            m = _ARGUMENTS.search(call.text)
            if m is None:
                self.calls[call.index] = (call_id, name, args)
                return events
            call.args_start = m.end()
        if not call.closed:
            value = call.text[call.args_start:]
            length, call.closed = _json_value_prefix(value)
            fragment = value[call.args_sent:length]
            call.args_sent = length
            if fragment:
                args += fragment
                events.append(CallEvent(call.index, arguments=fragment))
        self.calls[call.index] = (call_id, name, args)
        return events


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_value_prefix(text: str) -> tuple[int, bool]:
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
        elif depth == 0 and ch in ",\n" and i > 0:
            return i, True  # a scalar ended
    return len(text), False


def parser_for(name: str) -> type[HermesParser]:
    """The parser of `--tool-call-parser` (auto: Hermes, the format of the fallback prompt and
    of the templates with a `<tool_call>` tools branch)."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {PARSERS}")
    return HermesParser
