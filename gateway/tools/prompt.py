"""Tool calls in the prompt: tools and past calls rendered by the chat template (its tools
branch, or a fallback system block when it has none), in the format of the request's parser
(`--tool-call-parser`; `auto` picks it from the chat template)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from gateway.protocol import ChatCompletionRequest
from gateway.tool_parsers import (
    MISTRAL_TOOL_CALLS,
    PARSER_CLASSES,
    PYTHON_TAG,
    TOOL_CALL_END,
    TOOL_CALL_START,
)

PARSERS = ("auto", *PARSER_CLASSES)
_EXAMPLE = {  # how the fallback prompt shows one call, per format
    "hermes": f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-dict>}}\n'
              f"{TOOL_CALL_END}",
    "llama3_json": '{"name": <function-name>, "parameters": <args-dict>}',
    "mistral": f'{MISTRAL_TOOL_CALLS} [{{"name": <function-name>, "arguments": <args-dict>}}]',
}
_WRAPPING = {
    "hermes": f"within {TOOL_CALL_START}{TOOL_CALL_END} XML tags",
    "llama3_json": "as your whole reply (several calls joined by '; ')",
    "mistral": f"in a JSON list after {MISTRAL_TOOL_CALLS}",
}


def detect_parser(template: str | None, tools_branch: bool) -> str:
    """The parser `auto` stands for: the format the template's tools branch writes calls in;
    Hermes (the fallback prompt's) when it has none or none is recognised."""
    if not template or not tools_branch:
        return "hermes"
    if MISTRAL_TOOL_CALLS in template:
        return "mistral"
    if TOOL_CALL_START in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def parser_for(name: str) -> type:
    """The parser class of a resolved parser name (not `auto`)."""
    if name not in PARSER_CLASSES:
        raise ValueError(f"tool_call_parser must be one of {PARSERS}")
    return PARSER_CLASSES[name]


def calls_text(calls: list[tuple[str, Any]], parser: str) -> str:
    """Calls (name, arguments) written as the model writes them in `parser`'s format."""
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)
    if parser == "mistral":
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
        return f"{MISTRAL_TOOL_CALLS} {body}"
    return "\n".join(f"{TOOL_CALL_START}\n" + json.dumps({"name": n, "arguments": a},
                                                         ensure_ascii=False)
                     + f"\n{TOOL_CALL_END}" for n, a in calls)


def fallback_tools_prompt(tools: list[dict[str, Any]], parser: str = "hermes") -> str:
    """The system block for templates without a tools branch (Hermes / NousResearch style,
    with calls shown in `parser`'s format)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions. Here are the available tools: <tools>\n{listing}\n</tools>\n"
            "For each function call return a json object with function name and arguments "
            f"{_WRAPPING[parser]} as follows:\n{_EXAMPLE[parser]}")


def template_messages(request: ChatCompletionRequest, messages: list[dict[str, Any]],
                      tools_branch: bool, parser: str = "hermes"
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
            text = calls_text([(c["function"]["name"], c["function"]["arguments"])
                               for c in calls], parser)
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
