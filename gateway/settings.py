"""What the gateway is told at start (flags, or a test's choices): its settings and the
resumable streams' limits. Plain data, light to import, so that `pagedserve serve` parses its
flags and spawns its engines before it imports the web stack (gateway/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.reasoning import REASONING_PARSERS
from gateway.tools.registry import PARSERS


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    """How long and how much a resumable stream keeps for a reconnect."""

    grace_period: float = 30.0  # seconds with no reader before the generation is aborted
    max_stream_bytes: int = 1 << 20  # events kept per stream (oldest dropped first)
    max_event_age: float = 600.0  # seconds an event is kept
    max_total_bytes: int = 64 << 20  # events kept over all streams (the largest loses first)

    def __post_init__(self) -> None:
        for name in ("grace_period", "max_stream_bytes", "max_event_age", "max_total_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests not yet started by the engine
    allowed_origins: tuple[str, ...] = ()  # CORS and WebSocket Origin allow-list
    max_body_bytes: int = 4 * 1024 * 1024
    tokenizer: str | None = None  # overrides EngineReady.tokenizer
    # NOTE: SSE `: ping` comments after this many seconds without an event; None: never.
    # Off by default: neither OpenAI nor vLLM sends any, and `vllm bench serve` strips each
    # network read, so a ping that arrives alone glues itself to the next event
    # (docs/operations.md).
    sse_keepalive_interval: float | None = None
    chat_template: str | None = None  # a template's text, instead of the tokenizer's own
    drain_retry_after: int = 5
    ws_send_queue: int = 256  # frames queued per WebSocket before it is closed 1013
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector: a span per request
    split_special_tokens: bool = False  # client text's special-token strings stay plain text
    header_timeout: float = 10.0  # seconds to send a request's head (line and headers)
    body_timeout: float = 30.0  # seconds to send a request's whole body, once its head is in
    # how replies are split into content and tool calls: auto (from the chat template),
    # or a format of gateway/tools/registry.py FORMATS
    tool_call_parser: str = "auto"
    # /v1/responses with store: true (gateway/api/response_store.py): a memory budget in MiB
    # (0: keep none) and an age in seconds
    responses_store_mib: int = 64
    responses_store_ttl: float = 3600.0
    # splits chat replies into reasoning and answer: None (off) or a gateway/reasoning name
    reasoning_parser: str | None = None
    resumable_streams: bool = False  # streams resumable unless a request says `resumable: false`
    stream_limits: StreamLimits = field(default_factory=StreamLimits)  # grace period, bounds
    model_management: bool = False  # POST /models/load and /models/unload allowed
    # LoRA (gateway/api/lora.py): the engines' --enable-lora and --lora-modules, and whether
    # the load/unload routes are served
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        interval = self.sse_keepalive_interval
        if interval is not None and not interval > 0:
            raise ValueError("sse_keepalive_interval must be > 0 (or None: no keep-alive)")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}")
        if self.responses_store_mib < 0 or not self.responses_store_ttl > 0:
            raise ValueError("responses_store_mib must be >= 0 and responses_store_ttl > 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
