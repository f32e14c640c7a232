"""OpenAI request bodies as msgspec structs (with vLLM's extras); gateway/validate.py decodes
and checks them, gateway/responses.py holds the reply bodies.

Unknown request fields are ignored, as OpenAI's SDKs send fields a server may not know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

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


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None
