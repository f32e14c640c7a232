"""The gateway's shared state: engine client, tokenizer, admission, drain flag, live generations.

HTTP handlers and WebSocket sessions both turn requests into `Generation`s through `start`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.chunks import TokenNamer
from gateway.errors import ApiError, unavailable
from gateway.generation import EngineClientLike, Generation, Job
from gateway.lora_registry import LoraRegistry
from gateway.metrics import Metrics
from gateway.model_registry import ModelRegistry, UnknownModelError
from gateway.prompt_text import prompt_text_sizes
from gateway.reasoning import REASONING_PARSERS
from gateway.reasoning.think import ThinkParser
from gateway.requests import AnyRequest, ChatCompletionRequest, CompletionRequest
from gateway.resumable import StreamRegistry
from gateway.settings import GatewaySettings
from gateway.structured import structured_for, tool_choice_of
from gateway.tokenizer import Tokenizer
from gateway.tools.prompt import template_messages
from gateway.tools.registry import CallSyntax, detect_parser, format_for
from gateway.validate import check_limits, fill_max_tokens, to_sampling
from ipc.limits import Limits
from ipc.messages import LoadLoraAdapter, LoraAdapterResult, UnloadLoraAdapter

if TYPE_CHECKING:
    from gateway.tracing import RequestTracer


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
        # NOTE: several models: `for_model` gives each request a view of its model's engines
        self.models = self.client if isinstance(self.client, ModelRegistry) else None
        self._root = self  # the gateway a view was made from (its drain flag is the one)
        self._served_as: str | None = None  # a view's requested name (a model's or an alias)
        self.metrics = Metrics(lambda: self.client.stats, lambda: self.model_name,
                               self.models.model_stats if self.models else None)
        self.generations: dict[str, Generation] = {}
        self.streams = StreamRegistry(self.settings.stream_limits)
        self.metrics.watch_streams(self.streams)
        self.drain_listeners: list[Callable[[], None]] = []
        self._tokenizers: dict[str, Tokenizer] = {}
        self._syntax: dict[Path, CallSyntax] = {}  # per tokenizer directory
        self._unavailable = _engine_exception_types()
        s = self.settings
        # NOTE: one model's adapters; several models: each view has its own model's
        self.loras = LoraRegistry.from_modules(s.enable_lora, s.lora_modules)
        self.tracer: RequestTracer | None = None
        if self.settings.otlp_traces_endpoint:
            from gateway.tracing import RequestTracer

            self.tracer = RequestTracer(self.settings.otlp_traces_endpoint)

    # ---- readiness --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return (bool(self.client.ready) and self.client.info is not None
                and not self._root.draining)

    @property
    def model_name(self) -> str | None:
        info = self.client.info
        return info.model if info is not None else None

    def require_ready(self) -> None:
        if self._root.draining:
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
            self._tokenizers[path] = Tokenizer(path, self.settings.chat_template)
        return self._tokenizers[path]

    def namer(self, model: str | None = None) -> TokenNamer:
        """Names tokens as `model`'s tokenizer writes them (several models)."""
        try:
            return TokenNamer(self.for_model(model).tokenizer())
        except ApiError:
            # NOTE: unloaded since its request started (its stream ends with an abort): the
            # stream must still write its terminal event, so no error is raised mid-stream
            return TokenNamer(self.tokenizer())

    def limits(self) -> Limits:
        """The engine's context and logprobs cap (from its handshake: one limit, not two) and
        the tokenizer's vocabulary."""
        info = self.client.info
        assert info is not None, "limits asked before the engine was ready"
        return Limits(info.max_model_len, info.max_logprobs, self.tokenizer().vocab_size)

    def begin_drain(self) -> None:
        self.draining = True
        for listener in list(self.drain_listeners):
            listener()

    # ---- requests ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model a request names: the served one (by default) or one of its adapters."""
        served = self.model_name or ""
        if model in self.loras.paths:
            return model  # type: ignore[return-value]
        if model not in (None, "", served, self._served_as):
            raise ApiError(404, f"the model `{model}` does not exist", "model_not_found", "model")
        return self._served_as or served

    def for_model(self, model: str | None) -> Gateway:
        """The gateway as the model (or adapter) named `model` sees it: that model's engines,
        tokenizer and context, with the shared admission, generations, streams and metrics.
        One model (or a view already): itself. An unknown name: 404 model_not_found."""
        if self.models is None or self._root is not self:
            return self
        try:
            served = self.models.resolve(model)
        except UnknownModelError:
            raise ApiError(404, f"the model `{model}` does not exist", "model_not_found",
                           "model") from None
        view = copy.copy(self)
        view.client = served.engines
        view.loras = served.loras
        view._served_as = model or served.name
        return view

    async def prepare_all(self, request: AnyRequest) -> list[Job]:
        """One Job per prompt: several for a completions request with a list of prompts
        (engine request ids `<id>-<p>`, choices numbered from p * n)."""
        if isinstance(request, ChatCompletionRequest) or len(request.prompts) == 1:
            return [await self.prepare(request)]
        base = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        for p in range(len(request.prompts)):
            job = await self.prepare(request, p, f"{base}-{p}")
            job.response_id, job.index_base = base, p * request.n
            jobs.append(job)
        return jobs

    async def prepare(self, request: AnyRequest, prompt_index: int = 0,
                      request_id: str | None = None) -> Job:
        """Validate against the engine, tokenize, and build the Job (raises ApiError)."""
        view = self.for_model(request.model)
        if view is not self:
            return await view.prepare(request, prompt_index, request_id)
        self.require_ready()
        model = self.check_model(request.model)
        self._check_generates()
        syntax = self.call_syntax()
        structured = structured_for(request, syntax)
        # NOTE: the engine's context, already lowered to what its KV pool holds
        max_model_len = self.client.info.max_model_len  # type: ignore[union-attr]
        prompt_ids = await self._prompt_ids(request, max_model_len, prompt_index)
        reasoning = self._reasoning_parser(request, prompt_ids)
        special = reasoning is not None and _special_markers(self.tokenizer(), reasoning.func)
        if structured is not None and reasoning is not None:
            prefix = reasoning().grammar(special)
            if prefix is not None:  # NOTE: the grammar applies to the answer, after reasoning
                structured = msgspec.structs.replace(structured, reasoning=prefix)
        sampling = to_sampling(request, request.requested_max_tokens, structured)
        check_limits(request, self.limits(), prompt_ids, sampling)
        sampling = fill_max_tokens(sampling, max_model_len - len(prompt_ids))
        tool_parser = self._tool_parser(request, syntax)
        if special or (tool_parser is not None
                       and (syntax.special_opening or syntax.special_closing)):
            # NOTE: the parsers find calls and reasoning markers by their text, which a special
            # token only has when special tokens are kept (as vLLM does for Mistral)
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        prefix = "chatcmpl" if isinstance(request, ChatCompletionRequest) else "cmpl"
        request_id = request_id or request.request_id or f"{prefix}-{uuid.uuid4().hex}"
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
            lora_name=model if model in self.loras.paths else None,
            echo=self._echo_text(request, prompt_index),
            show_prompt_logprobs=request.prompt_logprobs is not None,
            tool_parser=tool_parser,
            reasoning_parser=reasoning,
        )

    def _check_generates(self) -> None:
        pooling = self.client.info.pooling  # type: ignore[union-attr]
        if pooling is not None and pooling.num_labels is not None:
            raise ApiError(400, "this model is a cross-encoder (a sequence classifier): it "
                           "scores query/document pairs on /v1/rerank and /score and does not "
                           "generate", "unsupported_model", "model")

    def pooling_ids(self, requested: str | None, prefix: str, count: int
                    ) -> tuple[str, list[str]]:
        """The id of a pooling request of `count` inputs (the client's `request_id`, else a
        new `<prefix>-<hex>`: cancel it by this id) and its engine requests' ids: that id for
        one input, else `<id>-<i>` (as a completions request's prompts). 400 if in use."""
        base = requested or f"{prefix}-{uuid.uuid4().hex}"
        ids = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
        if any(rid in self.generations for rid in ids) or any(
                g.job.response_id == base for g in self.generations.values()):
            raise ApiError(400, f"request_id `{base}` is in use", "duplicate_request_id",
                           "request_id")
        return base, ids

    def call_syntax(self) -> CallSyntax:
        """The tool-call format of `--tool-call-parser` (auto: the chat template's), and its
        opening as a special token of this tokenizer, if it is one."""
        tok = self.tokenizer()
        if tok.directory in self._syntax:
            return self._syntax[tok.directory]
        parser = self.settings.tool_call_parser
        if parser == "auto":
            parser = detect_parser(tok.template_source, tok.has_tools_branch)
        fmt = format_for(parser)
        syntax = CallSyntax(parser, _special(tok, fmt.opening), _special(tok, fmt.closing))
        self._syntax[tok.directory] = syntax
        return syntax

    def _tool_parser(self, request: AnyRequest,
                     syntax: CallSyntax) -> Callable[[], Any] | None:
        """A maker of the request's tool-call parser: it counts a call only when it names
        one of the request's tools (any other JSON is content)."""
        if not isinstance(request, ChatCompletionRequest) or not request.tools:
            return None
        if tool_choice_of(request) == "none":
            return None
        names = frozenset(t.function.name for t in request.tools)
        return functools.partial(syntax.format.parser, tools=names)

    def _reasoning_parser(self, request: AnyRequest, prompt_ids: list[int]
                          ) -> functools.partial[ThinkParser] | None:
        """A maker of the request's reasoning parser (`--reasoning-parser`; chat only, as
        vLLM), told how the prompt ends: a template may open or close the thinking itself."""
        name = self.settings.reasoning_parser
        if name is None or not isinstance(request, ChatCompletionRequest):
            return None
        cls = REASONING_PARSERS[name]
        if not cls.thinks(request.chat_template_kwargs or {}):
            return None
        tok = self.tokenizer()
        tail = tok.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return functools.partial(cls, tail, _one_token(tok, cls.start), _one_token(tok, cls.end))

    def start(self, job: Job) -> Generation:
        """Admit a Job: overload and engine-down become 503 with Retry-After."""
        view = self.for_model(job.model)
        if view is not self:
            return view.start(job)
        self.require_ready()
        limit = self.settings.max_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise unavailable("too many queued requests; retry later", "server_overloaded")
        try:
            gen = Generation(self.client, self.tokenizer(), job, self.metrics,
                             self.settings.sse_keepalive_interval)
        except self._unavailable as exc:
            raise unavailable(f"the engine is not available: {exc}", "engine_unavailable") from None
        self.generations[job.request_id] = gen
        return gen

    async def lora_request(self, msg: LoadLoraAdapter | UnloadLoraAdapter,
                           timeout: float) -> LoraAdapterResult:
        """The engines' answer to a LoRA load or unload (503 when they cannot answer)."""
        try:
            return await asyncio.wait_for(self.client.lora(msg), timeout)
        except TimeoutError:
            raise unavailable("the engine did not answer the LoRA request in time",
                              "engine_unavailable") from None
        except self._unavailable as exc:
            raise unavailable(f"the engine is not available: {exc}", "engine_unavailable") from None

    def finished(self, gen: Generation) -> None:
        if self.generations.get(gen.job.request_id) is gen:
            del self.generations[gen.job.request_id]
            if self.tracer is not None:
                self.tracer.record(gen)

    def cancel(self, request_id: str) -> bool:
        """Abort a running request by its id (a batched request: all of its prompts)."""
        ids = [rid for rid, g in self.generations.items()
               if request_id in (rid, g.job.response_id)]
        for rid in ids:
            self.client.abort(rid)
        return bool(ids)

    @property
    def num_waiting(self) -> int:
        """Requests no engine has scheduled yet: those its latest stats count as waiting, plus
        those sent since (neither running, waiting nor swapped there) beyond its free seats.

        NOTE: the engine reports after each step, and a prefill step can be long: a request
        on its way to an engine with a free seat (of max_num_seqs) is taken at its next step,
        so it does not count as queued, even before its first token."""
        stats, info = self.client.stats, self.client.info
        inflight = self.client.num_inflight
        if stats is None or info is None:
            return inflight
        busy = stats.num_running + stats.num_swapped
        in_transit = max(0, inflight - busy - stats.num_waiting)
        free_seats = 0 if stats.num_waiting else max(0, info.max_num_seqs - busy)
        return stats.num_waiting + max(0, in_transit - free_seats)

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

    async def chat_prompt_ids(self, request: Any, max_model_len: int | None = None
                              ) -> list[int]:
        """The token ids of a conversation (chat completions and /tokenize). Every text the
        template renders is counted first: too long for `max_model_len` is refused before it
        is rendered, and long ones are rendered and tokenized off the event loop."""
        tok = self.tokenizer()
        tools = request.tools if isinstance(request, ChatCompletionRequest) else None
        # NOTE: a per-request template's own text is written into the prompt too, and it is
        # compiled where the prompt is rendered (off the loop when the total is long)
        rendered = {name: getattr(request, name, None) for name in
                    ("chat_template_kwargs", "documents", "reasoning_effort", "chat_template")}
        sizes = prompt_text_sizes(request.messages, tools, rendered)
        if max_model_len is not None:
            _check_text_length(sizes, max_model_len, tok)
        parser = self.call_syntax().parser
        return await _off_loop(sum(sizes.values()), self._render_chat, request, tok, parser)

    def _render_chat(self, request: Any, tok: Tokenizer, parser: str) -> list[int]:
        template = getattr(request, "chat_template", None)
        kwargs = _template_kwargs(request, tok, template)
        messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
        tools = None
        if isinstance(request, ChatCompletionRequest):
            messages, tools = template_messages(request, messages, tok.reads("tools", template),
                                                parser)
        return tok.apply_chat_template(messages, request.add_generation_prompt,
                                       request.continue_final_message, kwargs,
                                       self.settings.split_special_tokens, tools, template,
                                       getattr(request, "add_special_tokens", False))

    async def encode_pair(self, first: str, second: str, param: str) -> list[int]:
        """The token ids of a cross-encoder's text pair (Tokenizer.encode_pair); too long for
        the engine's context is refused before it is tokenized, naming `param`."""
        tok = self.tokenizer()
        chars = len(first) + len(second)
        _check_text_length({param: chars}, self.client.info.max_model_len, tok)  # type: ignore[union-attr]
        return await _off_loop(chars, tok.encode_pair, first, second,
                               self.settings.split_special_tokens)

    async def encode_prompt(self, text: str, add_special_tokens: bool = False,
                            param: str = "prompt") -> list[int]:
        """The token ids of a completions prompt (completions, /tokenize, embeddings: `param`
        names the field); text too long for the engine's context is refused before it is
        tokenized."""
        tok = self.tokenizer()
        _check_text_length({param: len(text)}, self.client.info.max_model_len, tok)  # type: ignore[union-attr]
        return await _off_loop(len(text), tok.encode, text, add_special_tokens,
                               self.settings.split_special_tokens)

    def _echo_text(self, request: AnyRequest, prompt_index: int) -> str:
        """What `echo` puts before the output: the prompt (completions), or the last message
        when the reply continues the assistant's turn (chat, as vLLM)."""
        if not request.echo:
            return ""
        if isinstance(request, CompletionRequest):
            prompt = request.prompts[prompt_index]
            return prompt if isinstance(prompt, str) else self.tokenizer().decode(prompt)
        last = _message_dict(len(request.messages) - 1, request.messages[-1])
        return last["content"] if last["role"] == "assistant" else ""

    async def _prompt_ids(self, request: AnyRequest, max_model_len: int,
                          prompt_index: int = 0) -> list[int]:
        if isinstance(request, CompletionRequest):
            prompt = request.prompts[prompt_index]
            ids = (await self.encode_prompt(prompt, request.add_special_tokens)
                   if isinstance(prompt, str) else list(prompt))
        else:
            ids = await self.chat_prompt_ids(request, max_model_len)
        if not ids:
            raise ApiError(400, "the prompt is empty", "invalid_value", "prompt")
        return ids


# NOTE: encoding about 50k characters takes about 50 ms here; shorter texts stay on the loop
# (a thread hop costs more than their encode), longer ones go to a thread (`tokenizers`
# releases the GIL while it encodes).
_OFF_LOOP_CHARS = 16_384


async def _off_loop(chars: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """`fn(*args)` here for short texts, on a thread for long ones (chat: the template's
    rendering too, which for a huge tool schema took seconds)."""
    if chars < _OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _check_text_length(sizes: dict[str, int], max_model_len: int, tok: Tokenizer) -> None:
    """Refuse, before rendering or tokenizing, text that cannot fit: no token is longer than
    the vocabulary's longest, so more than max_model_len times that many characters (in all
    the fields `sizes` counts) is too long. The error names the field that brings the most."""
    chars = sum(sizes.values())
    limit = max_model_len * tok.max_token_chars
    if chars > limit:
        param = max(sizes, key=sizes.__getitem__)
        detail = f" ({param}: {sizes[param]})" if len(sizes) > 1 else ""
        raise ApiError(400, f"the prompt has {chars} characters{detail}; at most {limit} can "
                       f"fit in this model's context of {max_model_len} tokens",
                       "context_length_exceeded", param)


def _template_kwargs(request: Any, tok: Tokenizer, template: str | None) -> dict[str, Any]:
    """The template's extra variables: chat_template_kwargs, and vLLM's `documents` and
    `reasoning_effort`, each refused when the template does not read it."""
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    for name in ("documents", "reasoning_effort"):
        value = getattr(request, name, None)
        if value is None:
            continue
        if not tok.reads(name, template):
            raise ApiError(400, f"`{name}` is not supported by this model's chat template (it "
                           f"does not read `{name}`)", "unsupported_parameter", name)
        kwargs[name] = value
    return kwargs


# NOTE: enough of the prompt's end to hold a template's `<think>\n\n</think>\n\n`
_PROMPT_TAIL_TOKENS = 16


def _one_token(tok: Tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer writes it as one token."""
    ids = tok.encode(text)
    return ids[0] if len(ids) == 1 else None


def _special_markers(tok: Tokenizer, parser: Any) -> bool:
    return any(tok.special_token_id(m) is not None for m in (parser.start, parser.end))


def _special(tok: Tokenizer, text: str | None) -> str | None:
    """Lark for `text` as one special token of `tok` (`<[id]>`), or None."""
    token_id = tok.special_token_id(text) if text is not None else None
    return f"<[{token_id}]>" if token_id is not None else None


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
