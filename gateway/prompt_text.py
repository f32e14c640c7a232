"""How much text a chat request brings to its prompt: every string the chat template may
render (message contents and names, past tool calls, tools, template kwargs, documents), per
field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.requests import ChatMessage, Tool


def prompt_text_sizes(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                      fields: dict[str, Any]) -> dict[str, int]:
    """Characters per request field: "messages", "tools", and each of `fields` (the other
    request fields the template renders, by name: chat_template_kwargs, documents, ...).

    NOTE: a lower bound on what the template writes of each (it adds its own markup and JSON
    punctuation), so a request refused for its count could never have fit; each non-string
    scalar counts as one character, the least any rendering of it takes."""
    sizes = {
        "messages": sum(_message_chars(m) for m in messages),
        "tools": sum(_tool_chars(t) for t in tools or ()),
    }
    for name, value in fields.items():
        sizes[name] = _chars(value) if value is not None else 0
    return sizes


def _message_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        chars = sum(len(part.text or "") for part in content)
    else:
        chars = len(content or "")
    chars += len(message.name or "") + len(message.tool_call_id or "")
    for call in message.tool_calls or ():
        chars += len(call.id) + len(call.function.name) + len(call.function.arguments)
    return chars


def _tool_chars(tool: Tool) -> int:
    f = tool.function
    return len(f.name) + len(f.description or "") + (_chars(f.parameters) if f.parameters else 0)


def _chars(value: Any) -> int:
    """Characters of every key and string inside a JSON value (iterative: no recursion limit
    for a deeply nested schema)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) if isinstance(k, str) else 1 for k in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            total += 1
    return total
