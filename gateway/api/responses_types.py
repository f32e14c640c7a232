"""OpenAI Responses API bodies as msgspec structs: the request `POST /v1/responses` decodes
and the response object and output items it returns (shapes of openai-python's
`types/responses/`). Unknown request fields are ignored; refused ones are listed in
gateway/api/openai_responses.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from gateway.requests import NonNegInt, PosInt, Seed, Stop, StopTokenIds

ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class InputPart(msgspec.Struct, kw_only=True):
    """A content part of an input message: `input_text`, or `output_text` / `refusal` of an
    earlier assistant turn sent back."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a `message` (the type may be left out), a `function_call` the
    model made, its `function_call_output`, or a `reasoning` item sent back."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[InputPart] | None = None  # function_call_output
    id: str | None = None
    status: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    """A tool: only `function` tools (flat: name, description, parameters, strict)."""

    type: str
    name: ToolName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    # pagedserve: a stream that survives a dropped connection (None: --resumable-streams)
    resumable: bool | None = None
    # accepted, and change nothing here
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # checked: only the values that ask for nothing pass
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: NonNegInt | None = None
    reasoning: dict[str, Any] | None = None
    # vLLM's extras, as on chat
    seed: Seed | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- the response --------------------------------------------------------------------------


class OutputText(msgspec.Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


# NOTE: output items are tagged by `type` (msgspec writes it first), as OpenAI's are
class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ReasoningText(msgspec.Struct):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int  # input tokens served from the prefix cache
    # NOTE: OpenAI's count of explicit (paid, with a TTL) cache writes, required by its
    # current types; the prefix cache here is implicit, so none
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponsesUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(msgspec.Struct):
    code: str
    message: str


Status = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response object (`object: "response"`), as GET returns it and the stream's
    lifecycle events carry it."""

    id: str
    created_at: int
    model: str
    status: Status = "in_progress"
    output: list[OutputItem] = msgspec.field(default_factory=list)
    usage: ResponsesUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[ResponsesTool] = msgspec.field(default_factory=list)
    text: TextConfig | UnsetType = UNSET
    store: bool = True
    user: str | None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None
    object: Literal["response"] = "response"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["response"] = "response"


class ResponseEvent(msgspec.Struct):
    """Every streamed event has a `type` and a `sequence_number` (0, 1, ...); the other fields
    are those of openai-python's event of that type (`ResponseStreamEvent`)."""

    type: str
    sequence_number: int
