"""OpenAI request/response bodies as msgspec structs (with vLLM's extras) and their validation.

Unknown request fields are ignored, as OpenAI's SDKs send fields a server may not know.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from gateway.errors import ApiError
from ipc.sampling import SamplingParams, StructuredOutputs

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# NOTE: printable ASCII without space or `/`: it is sent back in the X-Request-Id header and
# names the request in the cancel URL's path.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[!-.0-~]+$")]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    """A call the assistant made (in replies, and in assistant messages sent back)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this is the result of


class JsonSchemaFormat(msgspec.Struct):
    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class FunctionDefinition(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no parameters
    strict: bool | None = None


class Tool(msgspec.Struct):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _Common(msgspec.Struct, kw_only=True):
    """Fields chat and completions requests share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PosInt = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    priority: Int32 = 0
    request_id: RequestId | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's removed guided decoding fields: refused with a 400 naming structured_outputs
    guided_json: msgspec.Raw | UnsetType = UNSET
    guided_regex: msgspec.Raw | UnsetType = UNSET
    guided_choice: msgspec.Raw | UnsetType = UNSET
    guided_grammar: msgspec.Raw | UnsetType = UNSET
    guided_decoding_backend: msgspec.Raw | UnsetType = UNSET
    guided_whitespace_pattern: msgspec.Raw | UnsetType = UNSET

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegInt | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: bool = True

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | TokenId]  # a text, a list of token ids, or a list of one text
    max_tokens: PosInt | None = 16
    logprobs: NonNegInt | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


AnyRequest = ChatCompletionRequest | CompletionRequest

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_request(body: bytes, kind: type[AnyRequest]) -> AnyRequest:
    """Parse and type-check a request body; every failure is a 400 ApiError."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise ApiError(400, "JSON is nested too deeply", "invalid_json") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1) if match else None
        if "missing required field" in message:
            code = "missing_required_parameter"
            name = re.search(r"field `([^`]*)`", message)
            field = name.group(1) if name else None
            param = f"{param}.{field}" if param and field else (field or param)
        else:  # NOTE: no path means the body itself is wrong (e.g. an array, not an object)
            code = "invalid_value" if param else "invalid_json"
        raise ApiError(400, message, code, param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", "invalid_json") from None
    check_request(request)
    return request


def check_request(request: AnyRequest) -> None:
    if request.n != 1:
        raise ApiError(400, "only n=1 is supported", "unsupported_value", "n")
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise ApiError(400, "messages must not be empty", "invalid_value", "messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "invalid_value", "top_logprobs")
    elif not isinstance(request.prompt, str):
        texts = [p for p in request.prompt if isinstance(p, str)]
        if not request.prompt or (texts and len(request.prompt) != 1):
            raise ApiError(
                400, "prompt must be a string, one list of token ids or a list of one string "
                "(batched prompts are not supported)", "invalid_value", "prompt",
            )


def to_sampling(request: AnyRequest, max_tokens: int, max_logprobs: int,
                structured: StructuredOutputs | None = None) -> SamplingParams:
    """Map a request onto SamplingParams; its ValueError becomes a 400 naming the field."""
    num_logprobs = request.num_logprobs
    if num_logprobs is not None and num_logprobs > max_logprobs:
        param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise ApiError(400, f"{param} must be <= {max_logprobs}", "invalid_value", param)
    given = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
    }
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=tuple(request.stop_list),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=num_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), "invalid_value", param) from None


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Timeline(msgspec.Struct):
    """One request's life (a pagedserve extension, in the final event). Times are Unix seconds:
    `scheduled` is the engine's clock, the others the gateway's. The counts are null when the
    engine did not report them (the gateway ended the request: a stop string, a disconnect)."""

    queued: float  # the gateway accepted the request
    scheduled: float | None  # the engine took it off its queue (null: never scheduled)
    first_token: float | None  # the gateway got the first output token
    finished: float  # the gateway got the last output (or ended the request)
    preemptions: int | None
    recomputed_tokens: int | None  # tokens computed again after preemptions that dropped KV
    cached_tokens: int  # prompt tokens served from the prefix cache
    spec_draft_tokens: int | None  # speculative decoding: draft tokens proposed
    spec_accepted_tokens: int | None  # and accepted


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobs(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprobs]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Message(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # left out when the reply made no calls


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # in the first delta of a call only
    arguments: str | None = None  # a fragment of the arguments' JSON text


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed call: the first delta carries id, type and name; later ones only index and
    argument fragments (as OpenAI streams them)."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: Message
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    timeline: Timeline | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # set in the usage chunk (stream_options.include_usage)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    # NOTE: UNSET fields are left out: only the chunk that carries finish_reason has one
    timeline: Timeline | UnsetType = UNSET


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # streamed: set in the usage chunk
    object: Literal["text_completion"] = "text_completion"
    timeline: Timeline | UnsetType = UNSET  # streamed: only in the chunk with finish_reason


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int | None = None
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
