"""What a request asks the output to look like, as one engine grammar: `response_format`,
vLLM's `structured_outputs`, or tool calls in the parser's format (forced by a `tool_choice` of
required or a named function; constrained once started for strict tools under auto).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import ApiError
from gateway.protocol import AnyRequest, ChatCompletionRequest, NamedToolChoice, Tool
from gateway.tool_parsers import MISTRAL_TOOL_CALLS, TOOL_CALL_END, TOOL_CALL_START
from ipc.sampling import StructuredOutputs

# NOTE: llguidance's JSON options for schemas embedded in a Lark grammar, matching the engine's
# spacing for plain schemas (engine/sched/structured/backend.py json_options).
_X_GUIDANCE = {"coerce_one_of": True, "item_separator": ", ", "key_separator": ": ",
               "whitespace_flexible": False}
# NOTE: Mistral's templates write each past call's 9-character id after its arguments
_MISTRAL_ID = {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}


@dataclass(frozen=True)
class CallSyntax:
    """How the request's tool-call parser writes calls: its name, and the Lark of its opening
    (and Hermes' closing tag) when the tokenizer has it as one special token (`<[id]>`), else
    None: the literal text."""

    parser: str = "hermes"
    special_opening: str | None = None
    special_closing: str | None = None


def structured_for(request: AnyRequest, syntax: CallSyntax = CallSyntax()
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
                      syntax: CallSyntax = CallSyntax()) -> str:
    """A Lark grammar of one call (or several, `parallel`) to these tools in the parser's
    format, each call's arguments constrained by its tool's parameters schema."""
    rules = _call_rules(tools, parallel, syntax, strict_only=False)
    if syntax.parser == "llama3_json":
        return f"start: calls\n{rules}"
    return f"start: {_opening(syntax)} calls\n{rules}"


def auto_tool_grammar(tools: list[Tool], parallel: bool,
                      syntax: CallSyntax = CallSyntax()) -> str:
    """`tool_choice: auto` with strict tools: any text, or calls; once a call's opening is
    written the rest of it must match (strict tools' arguments follow their schema, the other
    tools' arguments are any object).

    NOTE: an opening that is plain text ends a lazy lexeme (llguidance's tool-calling recipe):
    free text runs until the opening's first appearance, which then commits to a call.
    Llama 3 JSON has no opening: a reply is calls when it begins with `{`.
    """
    # NOTE: Hermes repeats whole calls (`lead calls`), each after its own stretch of text
    rules = _call_rules(tools, parallel and syntax.parser != "hermes", syntax, strict_only=True)
    text = "TEXT: /(.|\\n)*/\n"
    if syntax.parser == "llama3_json":
        return ("%llguidance {}\nstart: PLAIN | LEAD? calls\n"
                "PLAIN: /\\s*([^\\s{](.|\\n)*)?/\nLEAD: /\\s+/\n" + rules)
    if syntax.special_opening is not None:
        lead = f"lead: TEXT {syntax.special_opening}\n"
    else:
        lead = f"lead[lazy]: TEXT {json.dumps(_opening_text(syntax))}\n"
    start = "start: (lead calls)* TEXT" if parallel else "start: TEXT | lead calls"
    return f"%llguidance {{}}\n{start}\n{lead}{text}{rules}"


def _call_rules(tools: list[Tool], parallel: bool, syntax: CallSyntax,
                strict_only: bool) -> str:
    """Lark rules `calls` (what follows the opening) and `body` (one call's JSON)."""
    key = "parameters" if syntax.parser == "llama3_json" else "arguments"
    bodies = [{"type": "object",
               "properties": {"name": {"const": t.function.name},
                              key: _arguments_schema(t, strict_only),
                              **(_MISTRAL_ID if syntax.parser == "mistral" else {})},
               "required": ["name", key], "additionalProperties": False}
              for t in tools]
    body = f"body: %json {json.dumps({'anyOf': bodies, 'x-guidance': _X_GUIDANCE})}\n"
    if syntax.parser == "llama3_json":
        calls = 'calls: body ("; " body)*' if parallel else "calls: body"
    elif syntax.parser == "mistral":
        calls = 'calls: " [" body (", " body)* "]"' if parallel else 'calls: " [" body "]"'
    else:
        close = (f'"\\n" {syntax.special_closing}' if syntax.special_closing
                 else json.dumps(f"\n{TOOL_CALL_END}"))
        one = f'"\\n" body {close}'
        calls = f'calls: {one} ("\\n" {_opening(syntax)} {one})*' if parallel else f"calls: {one}"
    return f"{calls}\n{body}"


def _arguments_schema(tool: Tool, strict_only: bool) -> dict:
    if strict_only and not tool.function.strict:
        return {"type": "object"}
    return tool.function.parameters or {"type": "object"}


def _opening_text(syntax: CallSyntax) -> str:
    return MISTRAL_TOOL_CALLS if syntax.parser == "mistral" else TOOL_CALL_START


def _opening(syntax: CallSyntax) -> str:
    return syntax.special_opening or json.dumps(_opening_text(syntax))
