"""An Anthropic Messages request as the chat request it means (`ChatCompletionRequest`), so it
takes the one chat-template, tool and grammar path; fields that would change generation but
are not implemented are a 400 naming them."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

from gateway.api.anthropic_types import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ThinkingAdaptive,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.errors import ApiError
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
from gateway.validate import decode_body

# field -> why it is refused (the message says "`<field>` <why>")
REFUSED_FIELDS = {
    "container": "is not supported: no code-execution container runs here",
    "mcp_servers": "is not supported: the server connects to no MCP servers",
    "context_management": "is not supported: the context is never edited here",
    "output_format": "is not supported: use `output_config.format`",
}
_EMPTY = (b"null", b"[]", b"{}", b'""', b"false")
_Refused = msgspec.defstruct("_Refused", [(name, msgspec.Raw, msgspec.Raw(b"null"))
                                          for name in REFUSED_FIELDS])
_refused = msgspec.json.Decoder(_Refused)


def decode_messages(body: bytes, kind: type[CountTokensRequest]) -> Any:
    """Parse a /v1/messages (or count_tokens) body; every failure is a 400 naming the field."""
    try:
        request = decode_body(body, kind)
    except ApiError as exc:
        raise _reworded(exc) from None
    fields = _refused.decode(body)
    for name, why in REFUSED_FIELDS.items():
        if bytes(getattr(fields, name)).strip() not in _EMPTY:
            raise ApiError(400, f"`{name}` {why}", "unsupported_parameter", name)
    if not request.messages:
        raise ApiError(400, "messages must not be empty", "invalid_value", "messages")
    return request


def _reworded(exc: ApiError) -> ApiError:
    """A block or tool type not served here, said so (msgspec says `Invalid value`)."""
    param = exc.param or ""
    kind = re.match(r"Invalid (?:value|enum value) '([^']*)'", exc.message)
    if kind is None or not param.endswith(".type"):
        return exc
    if param.startswith(("messages", "system")):
        what = f"content block type `{kind.group(1)}` is not supported here (text, tool_use, "
        what += "tool_result and thinking are)"
    elif param.startswith("tools"):
        what = f"tool type `{kind.group(1)}` is not supported: only client tools (custom, "
        what += "with input_schema) are served here"
    else:
        return exc
    return ApiError(400, what, "unsupported_parameter", param)


def to_chat(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `request` stands for (count_tokens: without sampling fields)."""
    messages = [ChatMessage("system", _joined(request.system))] if request.system else []
    for i, message in enumerate(request.messages):
        messages += _messages(i, message)
    tools = [_tool(i, t) for i, t in enumerate(request.tools)] if request.tools else None
    choice, parallel = _tool_choice(request)
    chat = ChatCompletionRequest(
        messages=messages, model=request.model, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, chat_template_kwargs=_template_kwargs(request),
        response_format=_response_format(request), request_id=f"msg_{uuid.uuid4().hex}")
    if isinstance(request, MessagesRequest):
        _check_thinking(request)
        chat.max_tokens, chat.stream = request.max_tokens, request.stream
        chat.temperature, chat.top_p, chat.top_k = (request.temperature, request.top_p,
                                                    request.top_k)
        chat.stop = list(request.stop_sequences) if request.stop_sequences else None
        chat.user = request.metadata.user_id if request.metadata else None
        chat.seed, chat.logit_bias = request.seed, request.logit_bias
    last = request.messages[-1]
    if last.role == "assistant":
        # NOTE: Anthropic's prefill: the reply continues the final assistant turn
        if messages[-1].tool_calls:
            raise ApiError(400, "a final assistant turn cannot hold tool_use blocks (their "
                           "tool_result comes in a user turn after it)", "invalid_value",
                           f"messages[{len(request.messages) - 1}].content")
        chat.continue_final_message, chat.add_generation_prompt = True, False
    return chat


def _messages(i: int, message: InputMessage) -> list[ChatMessage]:
    """One Anthropic turn as chat messages: a user turn's tool results become `tool`
    messages (in order, around its text); an assistant's tool_use blocks its tool_calls;
    past thinking is dropped, as Anthropic drops it from the context."""
    role, content = message.role, message.content
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock) and role == "assistant":
            calls.append(ToolCall(block.id, FunctionCall(block.name, json.dumps(
                block.input, ensure_ascii=False))))
        elif isinstance(block, ToolResultBlock) and role == "user":
            if texts:
                out.append(ChatMessage(role, "".join(texts)))
                texts = []
            out.append(ChatMessage("tool", _result_text(block), tool_call_id=block.tool_use_id))
        elif role == "assistant" and block.__struct_config__.tag in ("thinking",
                                                                    "redacted_thinking"):
            continue
        else:
            raise ApiError(400, f"a {role} turn cannot hold a `{block.__struct_config__.tag}` "
                           "block", "invalid_value", f"{where}.type")
    if texts or calls or not out:
        out.append(ChatMessage(role, "".join(texts), tool_calls=calls or None))
    return out


def _result_text(block: ToolResultBlock) -> str:
    text = block.content if isinstance(block.content, str) else _joined(block.content or [])
    # NOTE: the model sees that the tool failed, as Anthropic shows it `is_error`
    return f"Error: {text}" if block.is_error else text


def _joined(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _tool(i: int, tool: ToolDefinition) -> Tool:
    for name in ("input_examples", "defer_loading"):
        if getattr(tool, name):
            raise ApiError(400, f"tools[{i}].{name} is not supported", "unsupported_parameter",
                           f"tools[{i}].{name}")
    if tool.allowed_callers not in (None, ["direct"]):
        raise ApiError(400, "only direct calls are made here (`allowed_callers: [\"direct\"]`)",
                       "unsupported_parameter", f"tools[{i}].allowed_callers")
    return Tool("function", FunctionDefinition(tool.name, tool.description, tool.input_schema,
                                               tool.strict))


def _tool_choice(request: CountTokensRequest) -> tuple[ToolChoice | None, bool]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    choice = request.tool_choice
    if choice is None:
        return None, True
    if isinstance(choice, ToolChoiceNone):
        return "none", True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    assert isinstance(choice, ToolChoiceTool)
    return NamedToolChoice("function", NamedFunction(choice.name)), parallel


def _template_kwargs(request: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` as the chat template's `enable_thinking` (Qwen3's and others' switch);
    adaptive leaves the template's default."""
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled):
        return {"enable_thinking": True}
    if isinstance(thinking, ThinkingDisabled):
        return {"enable_thinking": False}
    return None


def _check_thinking(request: MessagesRequest) -> None:
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled | ThinkingAdaptive) and thinking.display == "omitted":
        raise ApiError(400, "thinking.display `omitted` is not supported (thinking is shown)",
                       "unsupported_parameter", "thinking.display")
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens < request.max_tokens:
        # NOTE: nothing here ends reasoning early; a budget at or above max_tokens holds
        # because thinking and answer share max_tokens
        raise ApiError(400, f"a thinking budget below max_tokens ({request.max_tokens}) is "
                       "not enforced here: set budget_tokens >= max_tokens (thinking shares "
                       "max_tokens with the answer)", "unsupported_parameter",
                       "thinking.budget_tokens")


def _response_format(request: CountTokensRequest) -> ResponseFormat | None:
    config = request.output_config
    if config is None:
        return None
    if config.effort is not None:
        raise ApiError(400, "output_config.effort is not supported", "unsupported_parameter",
                       "output_config.effort")
    if config.format is None:
        return None
    return ResponseFormat("json_schema", JsonSchemaFormat("output", config.format.schema))
