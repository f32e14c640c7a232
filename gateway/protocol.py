"""OpenAI request/response bodies as msgspec structs (with vLLM's extras) and their validation.

Unknown request fields are ignored, as OpenAI's SDKs send fields a server may not know.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from gateway.errors import ApiError
from gateway.refused import check_refused
from ipc.sampling import SamplingParams, StructuredOutputs

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# NOTE: printable ASCII without space or `/`: it is sent back in the X-Request-Id header and
# names the request in the cancel URL's path.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[!-.0-~]+$")]
# NOTE: limits (README "Limits"): OpenAI allows 4 stop strings; vLLM sets no bound. Matching
# costs the same for any number of them (ipc.text.StopMatcher is one automaton); the bounds
# keep one request's automaton small and the text held back short.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopTokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]
# NOTE: OpenAI's roles; `tool` results are accepted (their rendering is the template's job).
Role = Literal["system", "developer", "user", "assistant", "tool"]


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
    role: Role
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
    strict: Annotated[bool, msgspec.Meta(description=(
        "with tool_choice auto, a call to this tool follows `parameters` once the model "
        "starts it (grammar-constrained); required and named calls always do"))] | None = None


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
    stop: Stop | None = None
    # accepted, and change nothing here (gateway/refused.py lists the refused fields)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extras
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    priority: Int32 = 0
    request_id: RequestId | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    use_beam_search: bool = False  # beam search of width n (outputs arrive when it ends)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    echo: bool = False  # completions: the prompt first; chat: the last message, if assistant's
    prompt_logprobs: NonNegInt | None = None  # completions: logprobs of the prompt's tokens
    length_penalty: float = 1.0  # with use_beam_search: scores divided by length ** this
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # pagedserve: a stream that survives a dropped connection (None: --resumable-streams)
    resumable: bool | None = None
    # vLLM's removed guided_* fields: gateway/refused.py answers them
    add_special_tokens: bool = False  # the tokenizer's special tokens (a BOS) added to the prompt

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
    continue_final_message: bool = False  # the reply continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    chat_template: str | None = None  # vLLM's: this request's template, not the model's
    # variables for templates that read them (a 400 names the field when this one does not)
    documents: list[dict[str, Any]] | None = None  # RAG documents (vLLM's)
    reasoning_effort: str | None = None  # e.g. gpt-oss's templates
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
    # a text, a list of texts, a list of token ids, or a list of token-id lists
    # NOTE: msgspec takes one array type per union; check_request refuses mixed lists
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: PosInt | None = 16
    logprobs: NonNegInt | None = None
    best_of: PosInt | None = None  # sample this many, return the n of highest logprob

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (choices of prompt p are numbered from p * n)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return [q for q in p if not isinstance(q, int)]  # type: ignore[misc]


AnyRequest = ChatCompletionRequest | CompletionRequest
MAX_PROMPTS = 64  # prompts in one completions request

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_request(body: bytes, kind: type[AnyRequest]) -> AnyRequest:
    """Parse and type-check a generation request; every failure is a 400 ApiError."""
    request = decode_body(body, kind)
    check_refused(body, chat=kind is ChatCompletionRequest)
    check_request(request)
    return request


def decode_body(body: bytes, kind: Any) -> Any:
    """Parse and type-check a body as `kind`; every failure is a 400 ApiError."""
    try:
        return msgspec.json.decode(body, type=kind)
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


def check_request(request: AnyRequest) -> None:
    best_of = getattr(request, "best_of", None)
    if request.stream and best_of is not None and best_of != request.n:
        raise ApiError(400, "best_of > n cannot be streamed (the best are known at the end)",
                       "invalid_value", "best_of")
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise ApiError(400, "messages must not be empty", "invalid_value", "messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "invalid_value", "top_logprobs")
        if request.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is only supported on /v1/completions",
                           "unsupported_parameter", "prompt_logprobs")
        if request.continue_final_message and request.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt=false",
                           "invalid_value", "continue_final_message")
    else:
        p = request.prompt
        kinds = {type(q) for q in p} if isinstance(p, list) else {str}
        if len(kinds) > 1:
            raise ApiError(400, "prompt must be a text, a list of texts, a list of token ids or "
                           "a list of token-id lists (not a mix)", "invalid_value", "prompt")
        prompts = request.prompts
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError(400, "prompt must not be empty", "invalid_value", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", "invalid_value",
                           "prompt")


def to_sampling(request: AnyRequest, max_tokens: int, max_logprobs: int,
                structured: StructuredOutputs | None = None) -> SamplingParams:
    """Map a request onto SamplingParams; its ValueError becomes a 400 naming the field."""
    num_logprobs = request.num_logprobs
    if num_logprobs is not None and num_logprobs > max_logprobs:
        param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise ApiError(400, f"{param} must be <= {max_logprobs}", "invalid_value", param)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None and prompt_logprobs > max_logprobs:
        raise ApiError(400, f"prompt_logprobs must be <= {max_logprobs}", "invalid_value",
                       "prompt_logprobs")
    if request.echo and num_logprobs is not None and isinstance(request, CompletionRequest):
        # NOTE: echo with logprobs shows the prompt's tokens' logprobs too (lm-eval's path)
        prompt_logprobs = max(prompt_logprobs or 0, num_logprobs)
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
            n=request.n,
            best_of=getattr(request, "best_of", None),
            use_beam_search=request.use_beam_search,
            length_penalty=request.length_penalty,
            logit_bias=_logit_bias(request.logit_bias),
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), "invalid_value", param) from None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys are token ids; got `{key}`", "invalid_value",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias values must be in [-100, 100]; got {value}",
                           "invalid_value", f"logit_bias.{key}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0  # output tokens inside the reasoning (--reasoning-parser)


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


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
    token_logprobs: list[float | None]  # None: the first prompt token (with echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's prompt_logprobs entry for one token id."""

    logprob: float
    rank: int | None
    decoded_token: str


class Message(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # left out when the reply made no calls
    # NOTE: with --reasoning-parser only. vLLM renamed `reasoning_content` (DeepSeek's name)
    # to `reasoning` (vLLM #27752) and later dropped the old name (#33402); clients still read
    # either (the Vercel AI SDK and LiteLLM read `reasoning_content`), so both carry it.
    reasoning_content: str | None | UnsetType = UNSET
    reasoning: str | None | UnsetType = UNSET


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
    reasoning_content: str | None = None  # reasoning text (both names: see Message)
    reasoning: str | None = None


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
    # vLLM's prompt_logprobs: per prompt token, {token id: entry}; None for the first token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


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
    root: str | None = None  # vLLM's: a LoRA adapter's directory
    parent: str | None = None  # vLLM's: a LoRA adapter's base model


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize with a prompt."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool = False  # NOTE: as /v1/completions encodes prompts here
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize with messages (rendered as /v1/chat/completions renders them)."""

    messages: list[ChatMessage]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
