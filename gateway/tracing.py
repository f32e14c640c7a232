"""One OpenTelemetry span per request, exported over OTLP/HTTP when `--otlp-traces-endpoint` is set.

The span runs from the gateway accepting the request to its last output, with events at the
engine's scheduling and the first token, the GenAI semantic-convention attributes, and the
request's timeline counts. A `traceparent` header on the request makes it a child span.
The OpenTelemetry SDK is imported only here, so it is needed only when tracing is on
(`pip install 'pagedserve[otel]'`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway.generation import Generation
from ipc.messages import FINISH_ERROR

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"  # as vLLM names it, so existing dashboards match


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint without a path is a collector's base URL: traces go to /v1/traces."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, not {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str = "pagedserve") -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise RuntimeError("tracing needs the OpenTelemetry SDK: "
                               "pip install 'pagedserve[otel]'") from exc
        self.endpoint = traces_url(endpoint)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
        self._tracer = self._provider.get_tracer("pagedserve.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._code = SpanKind.SERVER, Status, StatusCode

    def record(self, gen: Generation) -> None:
        """Emit the finished request's span (called once, when the gateway is done with it)."""
        job = gen.job
        parent = self._propagator.extract(job.trace_headers) if job.trace_headers else None
        end = gen.finished_time or job.arrival
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                       start_time=_ns(job.arrival),
                                       attributes=_attributes(gen))
        if gen.scheduled_time is not None:
            span.add_event("scheduled", timestamp=_ns(gen.scheduled_time))
        if gen.first_token_time is not None:
            span.add_event("first_token", timestamp=_ns(gen.first_token_time))
        if gen.finish_reason == FINISH_ERROR:
            span.set_status(self._status(self._code.ERROR, "the engine failed"))
        span.end(end_time=_ns(end))

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()


# NOTE: OpenTelemetry's GenAI operation names; rerank and score have none (their kind is used)
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings"}


def _attributes(gen: Generation) -> dict[str, Any]:
    job, s = gen.job, gen.job.sampling
    usage = gen.usage
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": _OPERATIONS.get(job.kind, job.kind),
        "gen_ai.request.model": job.model,
        "gen_ai.response.model": job.model,
        "gen_ai.response.id": job.request_id,
        "gen_ai.response.finish_reasons": [gen.finish_reason or "abort"],
        "gen_ai.request.max_tokens": s.max_tokens or 0,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "pagedserve.cached_tokens": usage["cached_tokens"],
    }
    if gen.scheduled_time is not None:
        attrs["gen_ai.latency.time_in_queue"] = max(0.0, gen.scheduled_time - job.arrival)
    if gen.first_token_time is not None:
        attrs["gen_ai.latency.time_to_first_token"] = gen.first_token_time - job.arrival
    if gen.finished_time is not None:
        attrs["gen_ai.latency.e2e"] = gen.finished_time - job.arrival
    m = gen.engine_metrics
    if m is not None:
        attrs.update({
            "pagedserve.preemptions": m.num_preemptions,
            "pagedserve.recomputed_tokens": m.num_recomputed_tokens,
            "pagedserve.spec_draft_tokens": m.num_spec_draft_tokens,
            "pagedserve.spec_accepted_tokens": m.num_spec_accepted_tokens,
        })
    return attrs


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers of an incoming request (empty when it has none)."""
    return {k: headers[k] for k in TRACE_HEADERS if k in headers}
