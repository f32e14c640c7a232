"""Response types as msgspec structs: unknown fields are ignored, enums are open strings.

NOTE: `finish_reason`, `role`, `status` stay `str`, so a value a newer server sends still
decodes; the StrEnums name the known values and compare equal to the strings.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"


class GenerationStatus(enum.StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class _Base(msgspec.Struct, kw_only=True):
    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class Usage(_Base):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(_Base):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Base):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Base):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Base):
    name: str = ""
    arguments: str = ""  # JSON text


class ToolCall(_Base):
    id: str = ""
    type: str = "function"
    function: FunctionCall = msgspec.field(default_factory=FunctionCall)


class ChatMessage(_Base):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Base):
    index: int = 0
    message: ChatMessage = msgspec.field(default_factory=ChatMessage)
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Base):
    id: str
    model: str = ""
    created: int = 0
    choices: list[ChatChoice] = []
    usage: Usage | None = None
    object: str = "chat.completion"


class FunctionCallDelta(_Base):
    name: str | None = None
    arguments: str | None = None  # a fragment of the arguments' JSON text


class ToolCallDelta(_Base):
    """A streamed call: the first delta of each index carries id, type and name."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta = msgspec.field(default_factory=FunctionCallDelta)


class Delta(_Base):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Base):
    index: int = 0
    delta: Delta = msgspec.field(default_factory=Delta)
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Base):
    id: str
    model: str = ""
    created: int = 0
    choices: list[ChatChunkChoice] = []
    usage: Usage | None = None
    object: str = "chat.completion.chunk"

    @property
    def text(self) -> str:
        """This chunk's new text (empty for role-only and usage chunks)."""
        return "".join(c.delta.content or "" for c in self.choices)


class CompletionLogprobs(_Base):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: the first prompt token (echo + logprobs)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(_Base):
    logprob: float
    rank: int | None = None
    decoded_token: str = ""


class CompletionChoice(_Base):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # with vLLM's prompt_logprobs: per prompt token {token id: entry}, None for the first
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(_Base):
    """A completions response, and also each chunk of a streamed one."""

    id: str
    model: str = ""
    created: int = 0
    choices: list[CompletionChoice] = []
    usage: Usage | None = None
    object: str = "text_completion"

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.choices)


class Model(_Base):
    id: str
    created: int = 0
    owned_by: str = ""
    max_model_len: int | None = None
    object: str = "model"
    parent: str | None = None  # a LoRA adapter's base model (its requests run there)


class ModelStatus(_Base):
    value: str  # loaded | loading | unloading | unloaded


class ModelState(_Base):
    """One model of `GET /models` (llama.cpp router's): its state, engines and memory."""

    id: str
    status: ModelStatus
    pids: list[int] = []  # its engine processes
    resident_bytes: int = 0  # their resident memory
    data_parallel_size: int | None = None
    object: str = "model"


class ModelStates(_Base):
    data: list[ModelState] = []
    object: str = "list"


class ModelLoaded(_Base):
    """The answer of `POST /models/load` and `/models/unload`."""

    success: bool
    model: str
    pids: list[int] = []  # the model's engine processes (started, or now exited)


class ModelList(_Base):
    data: list[Model] = []
    object: str = "list"


class Tokenized(_Base):
    """`POST /tokenize`'s answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class GenerationDone(_Base):
    """The `generation.done` frame of a WebSocket generation."""

    id: str
    status: str
    finish_reason: str | None = None
    finish_reasons: list[str | None] = []  # one per choice (n > 1)
    usage: Usage | None = None
