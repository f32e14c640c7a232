"""What a request asks the output to look like, as one engine grammar: `response_format`,
vLLM's `structured_outputs`, or the tools a `tool_choice` of required or a named function forces.
"""

from __future__ import annotations

import json

from gateway.errors import ApiError
from gateway.protocol import AnyRequest, ChatCompletionRequest, NamedToolChoice, Tool
from ipc.sampling import StructuredOutputs

# NOTE: llguidance's JSON options for schemas embedded in a Lark grammar, matching the engine's
# spacing for plain schemas (engine/structured/backend.py json_options).
_X_GUIDANCE = {"coerce_one_of": True, "item_separator": ", ", "key_separator": ": ",
               "whitespace_flexible": False}
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def structured_for(request: AnyRequest) -> StructuredOutputs | None:
    """The grammar the request's output must match, or None; invalid combinations are 400s."""
    found = [s for s in (_from_response_format(request), _from_structured_outputs(request),
                         _from_tools(request)) if s is not None]
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


def _from_tools(request: AnyRequest) -> StructuredOutputs | None:
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
        return StructuredOutputs(grammar=tool_call_grammar(named, False), param="tools")
    if choice == "required":
        return StructuredOutputs(grammar=tool_call_grammar(tools, request.parallel_tool_calls),
                                 param="tools")
    return None  # auto: the model chooses; its calls are parsed (gateway/tool_parsers.py)


def tool_call_grammar(tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar of Hermes-style calls (`<tool_call>` JSON `</tool_call>`) to these tools,
    their arguments constrained by each tool's parameters schema."""
    bodies = [{"type": "object",
               "properties": {"name": {"const": t.function.name},
                              "arguments": t.function.parameters or {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False}
              for t in tools]
    schema = {"anyOf": bodies, "x-guidance": _X_GUIDANCE}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return (f"{start}\n"
            f'call: "{TOOL_CALL_START}\\n" body "\\n{TOOL_CALL_END}"\n'
            f"body: %json {json.dumps(schema)}\n")

