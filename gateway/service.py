"""The gateway's shared state: engine client, tokenizer, admission, drain flag, live generations.

HTTP handlers and WebSocket sessions both turn requests into `Generation`s through `start`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.chunks import TokenNamer
from gateway.errors import ApiError, unavailable
from gateway.generation import EngineClientLike, Generation, Job
from gateway.metrics import Metrics
from gateway.protocol import AnyRequest, ChatCompletionRequest, CompletionRequest, to_sampling
from gateway.structured import structured_for, tool_choice_of
from gateway.tokenizer import Tokenizer
from gateway.tool_calls import parser_for, template_messages

if TYPE_CHECKING:
    from gateway.tracing import RequestTracer


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests not yet started by the engine
    allowed_origins: tuple[str, ...] = ()  # CORS and WebSocket Origin allow-list
    max_body_bytes: int = 4 * 1024 * 1024
    tokenizer: str | None = None  # overrides EngineReady.tokenizer
    max_logprobs: int = 20
    ping_interval: float = 1.0  # SSE `: ping` while nothing arrives
    drain_retry_after: int = 5
    ws_send_queue: int = 256  # frames queued per WebSocket before it is closed 1013
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector: a span per request
    tool_call_parser: str = "auto"  # how replies are split into content and tool calls


def _engine_exception_types() -> tuple[type[BaseException], ...]:
    try:
        from gateway.engine_client import EngineUnavailableError
    except ImportError:
        return ()
    return (EngineUnavailableError,)


@dataclass
class Gateway:
    client: EngineClientLike
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    draining: bool = False

    def __post_init__(self) -> None:
        self.metrics = Metrics(lambda: self.client.stats)
        self.generations: dict[str, Generation] = {}
        self.drain_listeners: list[Callable[[], None]] = []
        self._tokenizers: dict[str, Tokenizer] = {}
        self._unavailable = _engine_exception_types()
        self.tracer: RequestTracer | None = None
        if self.settings.otlp_traces_endpoint:
            from gateway.tracing import RequestTracer

            self.tracer = RequestTracer(self.settings.otlp_traces_endpoint)

    # ---- readiness --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.client.ready) and self.client.info is not None and not self.draining

    @property
    def model_name(self) -> str | None:
        info = self.client.info
        return info.model if info is not None else None

    def require_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down", "server_draining",
                              self.settings.drain_retry_after)
        if not self.ready:
            raise unavailable("the engine is not ready", "engine_unavailable")

    def tokenizer(self) -> Tokenizer:
        info = self.client.info
        path = self.settings.tokenizer or (info.tokenizer if info is not None else "")
        if not path:
            raise unavailable("the engine did not report a tokenizer", "engine_unavailable")
        if path not in self._tokenizers:
            self._tokenizers[path] = Tokenizer(path)
        return self._tokenizers[path]

    def namer(self) -> TokenNamer:
        return TokenNamer(self.tokenizer())

    def begin_drain(self) -> None:
        self.draining = True
        for listener in list(self.drain_listeners):
            listener()

    # ---- requests ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        served = self.model_name or ""
        if model not in (None, "", served):
            raise ApiError(404, f"the model `{model}` does not exist", "model_not_found", "model")
        return served

    def prepare(self, request: AnyRequest) -> Job:
        """Validate against the engine, tokenize, and build the Job (raises ApiError)."""
        self.require_ready()
        model = self.check_model(request.model)
        structured = structured_for(request)
        prompt_ids = self._prompt_ids(request)
        max_model_len = self.client.info.max_model_len  # type: ignore[union-attr]
        max_tokens = request.requested_max_tokens
        if len(prompt_ids) + (max_tokens or 1) > max_model_len:
            raise ApiError(
                400,
                f"this model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {len(prompt_ids)} and max_tokens asks {max_tokens or 1} more",
                "context_length_exceeded",
                "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
        max_tokens = max_tokens or max_model_len - len(prompt_ids)
        sampling = to_sampling(request, max_tokens, self.settings.max_logprobs, structured)
        prefix = "chatcmpl" if isinstance(request, ChatCompletionRequest) else "cmpl"
        request_id = request.request_id or f"{prefix}-{uuid.uuid4().hex}"
        if request_id in self.generations:
            raise ApiError(400, f"request_id `{request_id}` is in use", "duplicate_request_id",
                           "request_id")
        return Job(
            request_id=request_id,
            kind="chat" if isinstance(request, ChatCompletionRequest) else "completion",
            model=model,
            prompt_ids=prompt_ids,
            sampling=sampling,
            priority=request.priority,
            include_usage=request.include_usage,
            cache_salt=request.cache_salt,
            tool_parser=self._tool_parser(request),
        )

    def _tool_parser(self, request: AnyRequest):
        if not isinstance(request, ChatCompletionRequest) or not request.tools:
            return None
        if tool_choice_of(request) == "none":
            return None
        return parser_for(self.settings.tool_call_parser)

    def start(self, job: Job) -> Generation:
        """Admit a Job: overload and engine-down become 503 with Retry-After."""
        self.require_ready()
        limit = self.settings.max_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise unavailable("too many queued requests; retry later", "server_overloaded")
        try:
            gen = Generation(self.client, self.tokenizer(), job, self.metrics,
                             self.settings.ping_interval)
        except self._unavailable as exc:
            raise unavailable(f"the engine is not available: {exc}", "engine_unavailable") from None
        self.generations[job.request_id] = gen
        return gen

    def finished(self, gen: Generation) -> None:
        if self.generations.get(gen.job.request_id) is gen:
            del self.generations[gen.job.request_id]
            if self.tracer is not None:
                self.tracer.record(gen)

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.generations:
            return False
        self.client.abort(request_id)
        return True

    @property
    def num_waiting(self) -> int:
        return sum(1 for g in self.generations.values() if not g.started)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation runs (True) or `timeout` passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.generations and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.generations

    def abort_all(self) -> None:
        for request_id in list(self.generations):
            self.client.abort(request_id)

    def _prompt_ids(self, request: AnyRequest) -> list[int]:
        tok = self.tokenizer()
        if isinstance(request, CompletionRequest):
            prompt = request.prompt
            if isinstance(prompt, str):
                ids = tok.encode(prompt)
            elif isinstance(prompt[0], str):
                ids = tok.encode(prompt[0])  # type: ignore[arg-type]
            else:
                ids = list(prompt)  # type: ignore[arg-type]
        else:
            messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
            messages, tools = template_messages(request, messages, tok.has_tools_branch)
            ids = tok.apply_chat_template(messages, request.add_generation_prompt, tools)
        if not ids:
            raise ApiError(400, "the prompt is empty", "invalid_value", "prompt")
        if max(ids) >= tok.vocab_size:
            raise ApiError(400, f"token ids must be < {tok.vocab_size}", "invalid_value", "prompt")
        return ids


def _message_dict(index: int, message: Any) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content part type `{part.type}` is not supported",
                               "invalid_value", f"messages[{index}].content")
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out
