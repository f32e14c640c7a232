"""A Responses request as the ChatCompletionRequest every API runs through (one chat-template,
tool and grammar path): `input` items become chat messages, `text.format` becomes
`response_format`; fields that would change generation and are not implemented are 400s."""

from __future__ import annotations

from gateway.api.responses_types import InputItem, InputPart, ResponsesRequest, ResponsesTool
from gateway.errors import ApiError
from gateway.refused import REFUSED_FIELDS as CHAT_REFUSED
from gateway.refused import refusal_check
from gateway.requests import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
)

# field name -> why it is refused (the message says "`<field>` <why>"); false, null and empty
# values pass (clients send them as defaults)
REFUSED_FIELDS: dict[str, str] = {
    "background": "is not supported: responses run while the request is open (stream it)",
    "conversation": "is not supported: chain responses with `previous_response_id`",
    "prompt": "is not supported (stored prompt templates)",
    "include": "is not supported: there are no logprobs, encrypted reasoning or tool sources "
               "to include",
    "max_tool_calls": "is not supported",
    "context_management": "is not supported",
    "moderation": "is not supported",
    "image": "is not supported: text is the only modality",
}
# chat completions' fields, which would change generation there: named, not ignored, here
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "structured_outputs": "text.format"}
_CHAT_ONLY = ("n", "logprobs", "use_beam_search", "best_of", "echo", "prompt_logprobs",
              "length_penalty", "add_generation_prompt", "continue_final_message",
              "chat_template", "documents", "add_special_tokens", "reasoning_effort")
ALL_REFUSED = {**CHAT_REFUSED, **REFUSED_FIELDS,
               **{name: f"is a chat completions field: /v1/responses takes `{ours}`"
                  for name, ours in _CHAT_NAMES.items()},
               **{name: "is not supported on /v1/responses" for name in _CHAT_ONLY}}
check_refused = refusal_check(ALL_REFUSED)

# a chat request's field -> the Responses field it came from (error params name the latter)
_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
           ("reasoning_effort", "reasoning.effort"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat request's field (an error's `param`)."""
    if param is None:
        return None
    for chat, ours in _PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours + param[len(chat):]
    return param


def check_declared(r: ResponsesRequest) -> None:
    """The declared fields whose values ask for what is not implemented."""
    if r.truncation == "auto":
        raise _refused("truncation", "`auto` is not supported: a prompt that does not fit is a 400")
    if r.top_logprobs:
        raise _refused("top_logprobs", "is not supported on /v1/responses")
    for key in ("summary", "generate_summary"):
        if (r.reasoning or {}).get(key) is not None:
            raise _refused(f"reasoning.{key}", "is not supported: reasoning is returned as "
                           "written (with `--reasoning-parser`), never summarized")
    if r.text is not None and r.text.verbosity not in (None, "medium"):
        raise _refused("text.verbosity", "is not supported")


def to_chat(r: ResponsesRequest, history: list[ChatMessage], response_id: str
            ) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """(the chat request, the conversation it continues: `history` then `input`, without the
    instructions, which apply to this response only, as OpenAI)."""
    items = [InputItem(role="user", content=r.input)] if isinstance(r.input, str) else r.input
    conversation = history + messages_of(items)
    system = [ChatMessage("system", r.instructions)] if r.instructions else []
    tools = [_tool(i, t) for i, t in enumerate(r.tools)] if r.tools else None
    chat = ChatCompletionRequest(
        messages=system + conversation, model=r.model, stream=r.stream,
        max_completion_tokens=r.max_output_tokens, temperature=r.temperature, top_p=r.top_p,
        seed=r.seed, top_k=r.top_k, min_p=r.min_p, repetition_penalty=r.repetition_penalty,
        presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, stop=r.stop,
        stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos, min_tokens=r.min_tokens,
        logit_bias=r.logit_bias, skip_special_tokens=r.skip_special_tokens,
        include_stop_str_in_output=r.include_stop_str_in_output, priority=r.priority,
        cache_salt=r.cache_salt, chat_template_kwargs=r.chat_template_kwargs,
        reasoning_effort=_effort(r.reasoning),
        tools=tools, tool_choice=_tool_choice(r.tool_choice),
        parallel_tool_calls=r.parallel_tool_calls is not False,
        response_format=_response_format(r), request_id=response_id)
    return chat, conversation


def messages_of(items: list[InputItem]) -> list[ChatMessage]:
    """`input` items as chat messages: a function_call joins the assistant turn before it (or
    starts one), its output is a `tool` message; reasoning items sent back are left out, as
    chat templates leave out earlier turns' reasoning."""
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise ApiError(400, f"{where} has no `role`", "missing_required_parameter",
                               f"{where}.role")
            out.append(ChatMessage(item.role, _text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            call = ToolCall(_needs(item.call_id, where, "call_id"),
                            FunctionCall(_needs(item.name, where, "name"),
                                         _needs(item.arguments, where, "arguments")))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.output is None:
                raise ApiError(400, f"{where} has no `output`", "missing_required_parameter",
                               f"{where}.output")
            out.append(ChatMessage("tool", _text(item.output, f"{where}.output"),
                                   tool_call_id=_needs(item.call_id, where, "call_id")))
        elif item.type != "reasoning":
            raise ApiError(400, f"input items of type `{item.type}` are not supported (message, "
                           "function_call, function_call_output, reasoning are)",
                           "unsupported_parameter", f"{where}.type")
    return out


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text") and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise ApiError(400, f"content parts of type `{part.type}` are not supported (text "
                           "is the only modality)", "unsupported_parameter",
                           f"{where}[{j}].type")
    return "".join(texts)


def _needs(value: str | None, where: str, name: str) -> str:
    if value is None:
        raise ApiError(400, f"{where} has no `{name}`", "missing_required_parameter",
                       f"{where}.{name}")
    return value


def _tool(i: int, tool: ResponsesTool) -> Tool:
    if tool.type != "function":
        raise _refused(f"tools[{i}].type", f"`{tool.type}` is not supported: only `function` tools "
                "are (built-in tools such as web_search and file_search are not)")
    if tool.name is None:
        raise ApiError(400, f"tools[{i}] has no `name`", "missing_required_parameter",
                       f"tools[{i}].name")
    return Tool("function", FunctionDefinition(tool.name, tool.description, tool.parameters,
                                               tool.strict))


def _tool_choice(choice: str | dict | None) -> ToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")  # NOTE: chat's shape, accepted too
        name = choice.get("name", function.get("name") if isinstance(function, dict) else None)
        if isinstance(name, str):
            return NamedToolChoice("function", NamedFunction(name))
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise _refused("tool_choice", f"`{kind}` is not supported (none, auto, required or "
            "{\"type\": \"function\", \"name\": ...} are)")


def _response_format(r: ResponsesRequest) -> ResponseFormat | None:
    fmt = r.text.format if r.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    if fmt.schema is None:
        raise ApiError(400, "text.format of type json_schema needs `schema`",
                       "missing_required_parameter", "text.format.schema")
    return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name or "response", fmt.schema,
                                                          fmt.strict, fmt.description))


def _effort(reasoning: dict | None) -> str | None:
    """`reasoning.effort`, which chat's `reasoning_effort` passes to a template that reads it
    (else a 400 naming it)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise ApiError(400, "reasoning.effort must be a string", "invalid_value",
                       "reasoning.effort")
    return effort


def _refused(param: str, why: str) -> ApiError:
    return ApiError(400, f"`{param}` {why}", "unsupported_parameter", param)
