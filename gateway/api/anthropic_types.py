"""Anthropic Messages bodies as msgspec structs: the request, the reply, the stream's events.

Shapes follow the `anthropic` SDK's `types/`; unknown request fields are ignored (as on the
OpenAI routes), and the known ones that would change generation but are not implemented are
refused by `gateway/api/anthropic_messages.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.requests import MAX_STOP_STRINGS, NonNegInt, PosInt, StopString

# NOTE: Anthropic's tool-name rule (the SDK does not check it; the API does)
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


class _Block(msgspec.Struct, tag_field="type", kw_only=True):
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic


class TextBlock(_Block, tag="text"):
    text: str
    citations: list[dict[str, Any]] | None = None  # accepted on input; changes nothing


class ToolUseBlock(_Block, tag="tool_use"):
    """A call the assistant made (in a past assistant turn)."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    """A call's result (in a user turn): text, or text blocks."""

    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Block, tag="thinking"):
    """A past turn's thinking: dropped from the prompt, as Anthropic drops it."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str


InputBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[InputBlock]


class ToolDefinition(msgspec.Struct, kw_only=True):
    """A client tool. Server tools (`web_search_...`, `bash_...`, ...) are not served here."""

    name: ToolName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # the call follows input_schema (grammar-constrained)
    cache_control: dict[str, Any] | None = None
    eager_input_streaming: bool | None = None  # arguments always stream as they are written
    # NOTE: the three below change the prompt or who may call; refused when set
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None


class _Choice(msgspec.Struct, tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_Choice, tag="auto"):
    pass


class ToolChoiceAny(_Choice, tag="any"):
    pass


class ToolChoiceTool(_Choice, tag="tool"):
    name: str


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", kw_only=True):
    budget_tokens: PosInt
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive", kw_only=True):
    display: Literal["summarized", "omitted"] | None = None


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class JsonOutputFormat(msgspec.Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: JsonOutputFormat | None = None  # the reply's text follows the schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # refused


class Metadata(msgspec.Struct):
    user_id: str | None = None


StopSequences = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """/v1/messages/count_tokens: what the prompt of a /v1/messages request is made of."""

    model: str | None = None  # NOTE: Anthropic requires it; here None means the served model
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # accepted, and change nothing here
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """/v1/messages."""

    max_tokens: PosInt
    stop_sequences: StopSequences | None = None
    stream: bool = False
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: float | None = None
    top_k: NonNegInt | None = None
    metadata: Metadata | None = None
    # pagedserve extensions (as vLLM's extras on chat): a sampling seed, and token id (as a
    # string) -> a bias added to its logit
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    logit_bias: dict[str, float] | None = None
    # a stream that survives a dropped connection (None: --resumable-streams; docs/resume.md)
    resumable: bool | None = None
    # accepted, and change nothing here
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None


# ---- the reply -----------------------------------------------------------------------------


class OutText(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class OutToolUse(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class OutThinking(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # NOTE: nothing signs local reasoning; the SDK wants the field


OutBlock = OutText | OutToolUse | OutThinking
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(msgspec.Struct):
    """As Anthropic counts: input_tokens + cache_read_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageReply(msgspec.Struct):
    id: str
    model: str
    content: list[OutBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---- the stream's events (each sent as `event: <type>` + `data: <json>`) ------------------


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessageReply


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: OutBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


BlockDelta = TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: MessageUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


StreamEvent = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop
               | MessageDelta | MessageStop | Ping)
