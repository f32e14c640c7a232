"""Tool calls in the prompt: tools and past calls rendered by the chat template (its tools
branch, or a fallback system block when it has none), in the request's format
(`--tool-call-parser`; `auto` picks it from the chat template: gateway/tools/registry.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gateway.requests import ChatCompletionRequest
from gateway.tools.registry import FALLBACK, format_for


def fallback_tools_prompt(tools: list[dict[str, Any]], parser: str = FALLBACK) -> str:
    """The system block for templates without a tools branch (Hermes / NousResearch style,
    with calls shown in `parser`'s format)."""
    fmt = format_for(parser)
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions. Here are the available tools: <tools>\n{listing}\n</tools>\n"
            "For each function call return a json object with function name and arguments "
            f"{fmt.wrapping} as follows:\n{fmt.example}")


def template_messages(request: ChatCompletionRequest, messages: list[dict[str, Any]],
                      tools_branch: bool, parser: str = FALLBACK
                      ) -> tuple[list[dict[str, Any]], list | None]:
    """(messages, tools) for the chat template: past calls and tool results in the shape HF
    templates read, or folded into text in `parser`'s format when the template has no tools
    branch."""
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
            text = format_for(parser).calls_text(
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            out["content"] = f"{out['content']}\n{text}" if out["content"] else text
        if out["role"] == "tool":
            out.pop("tool_call_id", None)
            out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    if tools and request.tool_choice != "none":
        block = fallback_tools_prompt(tools, parser)
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
