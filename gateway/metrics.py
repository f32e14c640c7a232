"""Prometheus metrics with fixed names (dashboards rely on them); engine gauges read on scrape.

Beside our `pagedserve_*` names, the ones vLLM exports (`vllm:*`, label `model_name`) that we
can fill truthfully, so routers that score model servers by them (the Gateway API Inference
Extension, llm-d) work unchanged (docs/scale-out.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ipc.messages import GRAMMAR_COMPILE_BUCKETS, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PerModel = Callable[[], list[tuple[str, EngineStats | None]]]
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


# (kind, metric name, help, EngineStats field): read straight from the latest stats
_ENGINE_METRICS = (
    (GaugeMetricFamily, "pagedserve_requests_running", "Requests running in the engine",
     "num_running"),
    (GaugeMetricFamily, "pagedserve_requests_waiting", "Requests waiting in the engine's queue",
     "num_waiting"),
    (GaugeMetricFamily, "pagedserve_kv_blocks_free", "Free KV blocks", "kv_blocks_free"),
    (GaugeMetricFamily, "pagedserve_kv_blocks_total", "KV blocks in the pool", "kv_blocks_total"),
    (CounterMetricFamily, "pagedserve_preemptions", "Requests preempted by the scheduler",
     "num_preemptions"),
    (GaugeMetricFamily, "pagedserve_requests_swapped",
     "Requests whose KV is swapped out to the CPU pool", "num_swapped"),
    (GaugeMetricFamily, "pagedserve_kv_cpu_blocks_free", "Free blocks in the CPU swap pool",
     "kv_cpu_blocks_free"),
    (GaugeMetricFamily, "pagedserve_kv_cpu_blocks_total", "Blocks in the CPU swap pool",
     "kv_cpu_blocks_total"),
    (CounterMetricFamily, "pagedserve_prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    (CounterMetricFamily, "pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
     "prefix_cache_hits"),
    (CounterMetricFamily, "pagedserve_spec_decode_draft_tokens",
     "Draft tokens proposed for verification", "spec_draft_tokens"),
    (CounterMetricFamily, "pagedserve_spec_decode_accepted_tokens",
     "Draft tokens the target accepted", "spec_accepted_tokens"),
    (CounterMetricFamily, "pagedserve_spec_decode_verify_steps",
     "Verifications (accepted / verify_steps = mean accepted length)", "spec_verify_steps"),
    (CounterMetricFamily, "pagedserve_grammar_cache_hits",
     "Structured-output requests whose grammar was already compiled", "grammar_cache_hits"),
    (CounterMetricFamily, "pagedserve_grammar_waits",
     "Requests that waited for their grammar to compile", "grammar_waits"),
    (CounterMetricFamily, "pagedserve_grammar_failures",
     "Grammars the engine refused or could not compile in time", "grammar_failures"),
)


# (kind, name, help, EngineStats field): a model's adapters, labelled by model_name as vLLM's
# series are (each model's own engines: adapters are per model)
_LORA_METRICS = (
    (GaugeMetricFamily, "pagedserve_lora_adapters",
     "LoRA adapters loaded (summed over the model's engines)", "lora_adapters"),
    (GaugeMetricFamily, "pagedserve_lora_slots_used", "LoRA device slots holding an adapter",
     "lora_slots_used"),
    (GaugeMetricFamily, "pagedserve_lora_slots_total", "LoRA device slots (max_loras)",
     "lora_slots_total"),
    (GaugeMetricFamily, "pagedserve_lora_cpu_bytes",
     "Host bytes of the LoRA adapters read (the max_cpu_loras cache)", "lora_cpu_bytes"),
)


# (kind, vLLM's name, help, EngineStats field), labelled by model_name as vLLM's are
_VLLM_ENGINE_METRICS = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Requests in model execution batches",
     "num_running"),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be processed",
     "num_waiting"),
    (GaugeMetricFamily, "vllm:num_requests_swapped", "Requests swapped to the CPU",
     "num_swapped"),
    (CounterMetricFamily, "vllm:num_preemptions", "Cumulative preemptions", "num_preemptions"),
    (CounterMetricFamily, "vllm:prefix_cache_queries",
     "Prefix cache queries, in tokens", "prefix_cache_queries"),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in tokens",
     "prefix_cache_hits"),
    (CounterMetricFamily, "vllm:prompt_tokens", "Prefill tokens processed", "prompt_tokens"),
    (CounterMetricFamily, "vllm:generation_tokens", "Generation tokens processed",
     "generation_tokens"),
    (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
     "spec_draft_tokens"),
    (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
     "spec_accepted_tokens"),
)


class _EngineCollector(Collector):
    """Gauges and engine counters come straight from the latest EngineStats."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 model: Callable[[], str | None], per_model: PerModel | None = None) -> None:
        self._stats = stats
        self._model = model
        self._per_model = per_model or (lambda: [(model() or "", stats())])

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats() or EngineStats()
        for family, name, help_text, field in _ENGINE_METRICS:
            yield family(name, help_text, value=getattr(s, field))
        yield GaugeMetricFamily("pagedserve_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                                value=_ratio(s.kv_blocks_total - s.kv_blocks_free,
                                             s.kv_blocks_total))
        yield GaugeMetricFamily("pagedserve_spec_decode_acceptance_ratio",
                                "Accepted / proposed draft tokens",
                                value=_ratio(s.spec_accepted_tokens, s.spec_draft_tokens))
        yield _labelled("pagedserve_preemptions_by_kind", "Preemptions by how the KV was handled",
                        "kind", {"swap": s.num_preemptions_swap,
                                 "recompute": s.num_preemptions_recompute})
        yield _labelled("pagedserve_swap_bytes", "KV bytes copied between the pools",
                        "direction", {"out": s.swap_out_bytes, "in": s.swap_in_bytes})
        yield _labelled("pagedserve_spec_decode_accepted_by_position",
                        "Draft tokens accepted at each position of the proposal", "position",
                        {str(i): n for i, n in enumerate(s.spec_accepted_by_position)})
        yield from self._vllm(s)

    def _vllm(self, s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # NOTE: one series per served model, from that model's engines (several models):
        # vLLM's, and ours of its LoRA adapters
        models = [(name, m or EngineStats()) for name, m in self._per_model()]
        for family, name, help_text, field in _VLLM_ENGINE_METRICS + _LORA_METRICS:
            metric = family(name, help_text, labels=["model_name"])
            for model, ms in models:
                metric.add_metric([model], getattr(ms, field))
            yield metric
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage: 1 means 100 percent", labels=["model_name"])
        for model, ms in models:
            usage.add_metric([model], _ratio(ms.kv_blocks_total - ms.kv_blocks_free,
                                             ms.kv_blocks_total))
        yield usage
        yield _grammar_histogram(s)


def _grammar_histogram(s: EngineStats) -> HistogramMetricFamily:
    counts = s.grammar_compile_seconds_buckets or [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
    bounds = [str(b) for b in GRAMMAR_COMPILE_BUCKETS] + ["+Inf"]
    return HistogramMetricFamily(
        "pagedserve_grammar_compile_seconds", "Time to compile a structured-output grammar",
        buckets=list(zip(bounds, counts, strict=True)), sum_value=s.grammar_compile_seconds_sum)


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _labelled(name: str, help_text: str, label: str,
              values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


# (kind, name, help, attribute of the gateway's StreamRegistry): resumable streams
_STREAM_METRICS = (
    (GaugeMetricFamily, "pagedserve_resumable_streams",
     "Resumable streams held (generating, or kept for a reconnect)", "num_streams"),
    (GaugeMetricFamily, "pagedserve_resumable_streams_unread",
     "Resumable streams with no reader attached (their grace period runs)", "unread"),
    (GaugeMetricFamily, "pagedserve_resumable_buffered_bytes",
     "Event bytes buffered for reconnects, over all streams", "buffered_bytes"),
    (CounterMetricFamily, "pagedserve_stream_resumes", "Readers that resumed a stream",
     "resumes"),
    (CounterMetricFamily, "pagedserve_streams_expired",
     "Streams forgotten after a grace period with no reader", "expired"),
    (CounterMetricFamily, "pagedserve_streams_expired_aborted",
     "Expired streams whose generation was still running (aborted then)", "aborted"),
    (CounterMetricFamily, "pagedserve_stream_events_dropped",
     "Buffered events dropped by the per-stream, global or age bound", "events_dropped"),
)


class _StreamCollector(Collector):
    def __init__(self, registry: object) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for family, name, help_text, attr in _STREAM_METRICS:
            yield family(name, help_text, value=getattr(self._registry, attr))


class _Histograms:
    """Ours and vLLM's name for one histogram, observed together."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry, model: Callable[[], str | None]) -> None:
        self.ours = Histogram(f"pagedserve_{name}", help_text, buckets=buckets,
                              registry=registry)
        self.vllm = Histogram(f"vllm:{name}", help_text, ["model_name"], buckets=buckets,
                              registry=registry)
        self._model = model
        self._child: tuple[str, Histogram] | None = None  # (model name, its labelled series)

    def observe(self, value: float, model: str | None = None) -> None:
        """`model`: the request's model (several models); default: the served one."""
        self.ours.observe(value)
        # NOTE: the labelled series kept while the model name holds: `labels()` takes a lock
        # and a dict lookup per call, and the inter-token histogram is observed per token
        name = model or self._model() or ""
        if self._child is None or self._child[0] != name:
            self._child = (name, self.vllm.labels(model_name=name))
        self._child[1].observe(value)


_VLLM_SUCCESS = ("stop", "length", "abort")  # vLLM counts these finishes as successes


class Metrics:
    """One registry per app, so tests can build several apps in one process."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 model: Callable[[], str | None] = lambda: None,
                 per_model: PerModel | None = None) -> None:
        """`per_model`: (model name, its stats) of each served model, when there are several."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._model = model
        self.ttft = _Histograms("time_to_first_token_seconds", "Arrival to first output token",
                                _LATENCY_BUCKETS, r, model)
        self.itl = _Histograms("inter_token_latency_seconds", "Time between output tokens",
                               _TOKEN_BUCKETS, r, model)
        self.e2e = _Histograms("e2e_request_latency_seconds", "Arrival to the last output",
                               _LATENCY_BUCKETS, r, model)
        self.queue_time = _Histograms(
            "request_queue_time_seconds",
            "Arrival at the gateway until the engine first schedules the request",
            _LATENCY_BUCKETS, r, model)
        self.vllm_success = Counter("vllm:request_success", "Successfully finished requests",
                                    ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Output tokens streamed", registry=r
        )
        self.client_disconnects = Counter(
            "pagedserve_client_disconnects", "Clients gone before their request finished",
            registry=r,
        )
        self.requests = Counter(
            "pagedserve_requests", "Finished requests", ["finish_reason"], registry=r
        )
        r.register(_EngineCollector(stats, model, per_model))

    def watch_streams(self, registry: object) -> None:
        """Export the resumable-stream gauges and counters of a gateway.resumable registry."""
        self.registry.register(_StreamCollector(registry))

    def finished(self, reason: str, model: str | None = None) -> None:
        """Count a finished request (by its finish reason, and model)."""
        self.requests.labels(finish_reason=reason).inc()
        if reason in _VLLM_SUCCESS:
            self.vllm_success.labels(model_name=model or self._model() or "",
                                     finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
