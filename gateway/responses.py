"""OpenAI (and vLLM) reply bodies as msgspec structs: chat and completion objects and chunks,
usage, logprobs, the request timeline, models and tokenize results."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from gateway.requests import ToolCall


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


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
