"""What a request asks the output to look like, as one engine grammar: `response_format`,
vLLM's `structured_outputs`, or tool calls in the request's format (forced by a `tool_choice` of
required or a named function; constrained once started for strict tools under auto).
"""

from __future__ import annotations

import json

from gateway.errors import ApiError
from gateway.requests import AnyRequest, ChatCompletionRequest, NamedToolChoice, Tool
from gateway.tools.registry import CallSyntax
from ipc.sampling import StructuredOutputs

# NOTE: llguidance's JSON options for schemas embedded in a Lark grammar, matching the engine's
# spacing for plain schemas (engine/sched/structured/backend.py json_options).
_X_GUIDANCE = {"coerce_one_of": True, "item_separator": ", ", "key_separator": ": ",
               "whitespace_flexible": False}
_FALLBACK = CallSyntax()  # the fallback prompt's format, its tags as text


def structured_for(request: AnyRequest, syntax: CallSyntax = _FALLBACK
                   ) -> StructuredOutputs | None:
    """The grammar the request's output must match, or None; invalid combinations are 400s."""
    found = [s for s in (_from_response_format(request), _from_structured_outputs(request),
                         _from_tools(request, syntax)) if s is not None]
    if len(found) > 1:
        raise ApiError(400, f"{found[0].param} and {found[1].param} cannot both constrain "
                       "the output", "invalid_value", found[1].param)
    return found[0] if found else None


def tool_choice_of(request: ChatCompletionRequest) -> str | NamedToolChoice:
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def _from_response_format(request: AnyRequest) -> StructuredOutputs | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if fmt.json_schema is None:
        raise ApiError(400, "response_format of type json_schema needs `json_schema`",
                       "missing_required_parameter", "response_format.json_schema")
    schema = fmt.json_schema.schema
    if schema is None:
        return StructuredOutputs(json_object=True, param="response_format")
    return StructuredOutputs(json=json.dumps(schema), param="response_format")


def _from_structured_outputs(request: AnyRequest) -> StructuredOutputs | None:
    so = request.structured_outputs
    if so is None:
        return None
    schema = so.json if isinstance(so.json, str) or so.json is None else json.dumps(so.json)
    try:
        return StructuredOutputs(
            json=schema, json_object=bool(so.json_object), regex=so.regex,
            choice=tuple(so.choice) if so.choice is not None else None, grammar=so.grammar,
            whitespace_pattern=so.whitespace_pattern, param="structured_outputs")
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value", "structured_outputs") from None


def _from_tools(request: AnyRequest, syntax: CallSyntax) -> StructuredOutputs | None:
    if not isinstance(request, ChatCompletionRequest):
        return None
    choice = tool_choice_of(request)
    tools = request.tools or []
    if choice != "none" and not tools:
        raise ApiError(400, "tool_choice needs `tools`", "invalid_value", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ApiError(400, f"tool_choice names `{choice.function.name}`, which is not "
                           "in tools", "invalid_value", "tool_choice")
        return StructuredOutputs(grammar=tool_call_grammar(named, False, syntax), param="tools")
    if choice == "required":
        return StructuredOutputs(
            grammar=tool_call_grammar(tools, request.parallel_tool_calls, syntax), param="tools")
    if choice == "auto" and any(t.function.strict for t in tools):
        return StructuredOutputs(
            grammar=auto_tool_grammar(tools, request.parallel_tool_calls, syntax),
            param="tools")
    return None  # none, or auto without strict tools: calls are parsed, not constrained


def tool_call_grammar(tools: list[Tool], parallel: bool,
                      syntax: CallSyntax = _FALLBACK) -> str:
    """A Lark grammar of one call (or several, `parallel`) to these tools in the request's
    format, each call's arguments constrained by its tool's parameters schema."""
    rules = _call_rules(tools, parallel, syntax, strict_only=False)
    return f"{syntax.format.forced_start(syntax)}\n{rules}"


def auto_tool_grammar(tools: list[Tool], parallel: bool,
                      syntax: CallSyntax = _FALLBACK) -> str:
    """`tool_choice: auto` with strict tools: any text, or calls; once a call's opening is
    written the rest of it must match (strict tools' arguments follow their schema, the other
    tools' arguments are any object). The format frames it (ToolFormat.auto_grammar)."""
    fmt = syntax.format
    rules = _call_rules(tools, parallel and fmt.joins_calls, syntax, strict_only=True)
    return fmt.auto_grammar(rules, parallel, syntax)


def _call_rules(tools: list[Tool], parallel: bool, syntax: CallSyntax,
                strict_only: bool) -> str:
    """Lark rules `calls` (what follows the opening) and `body` (one call's JSON)."""
    fmt = syntax.format
    key = fmt.args_key
    bodies = [{"type": "object",
               "properties": {"name": {"const": t.function.name},
                              key: _arguments_schema(t, strict_only),
                              **fmt.call_properties()},
               "required": ["name", key], "additionalProperties": False}
              for t in tools]
    body = f"body: %json {json.dumps({'anyOf': bodies, 'x-guidance': _X_GUIDANCE})}\n"
    return f"{fmt.calls_rule(parallel, syntax)}\n{body}"


def _arguments_schema(tool: Tool, strict_only: bool) -> dict:
    if strict_only and not tool.function.strict:
        return {"type": "object"}
    return tool.function.parameters or {"type": "object"}
