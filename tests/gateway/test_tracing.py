"""An OpenTelemetry span per request, exported over OTLP/HTTP to a collector on 127.0.0.1 that
decodes what it receives with the OTLP protobuf types."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from gateway_fakes import FAKE_COUNTS, FakeEngine, serve
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import build_app
from gateway.cli import build_parser, check_args
from gateway.settings import GatewaySettings
from gateway.tracing import traces_url

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
# NOTE: the first request loads the tokenizer and renders the chat template on the loop that
# also serves the collector and this client: on a loaded machine that took more than httpx's
# default 5 s. Every wait here is explicit and generous instead.
WAIT_S = 60.0


def collector(received: list[ExportTraceServiceRequest]) -> Starlette:
    async def traces(request: Request) -> Response:
        assert request.headers["content-type"] == "application/x-protobuf"
        received.append(ExportTraceServiceRequest.FromString(await request.body()))
        return Response(b"", media_type="application/x-protobuf")

    return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def attributes(span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([v.string_value for v in value.array_value.values]
                       if kind == "array_value" else getattr(value, kind))
    return out


async def test_one_span_per_request_with_timeline_and_parent(fake_engine: FakeEngine) -> None:
    received: list[ExportTraceServiceRequest] = []
    async with serve(collector(received)) as otlp:
        app = build_app(fake_engine, GatewaySettings(otlp_traces_endpoint=otlp))
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
            reply = (await http.post("/v1/chat/completions", json=CHAT,
                                     headers={"traceparent": TRACEPARENT})).json()
            streamed = await http.post("/v1/completions",
                                       json={"prompt": "x", "max_tokens": 3, "stream": True})
            assert streamed.status_code == 200
            ws_url = url.replace("http://", "ws://") + "/v1/ws"
            async with websockets.connect(ws_url, subprotocols=["pagedserve.v1"]) as ws:
                await asyncio.wait_for(ws.recv(), WAIT_S)  # session.created
                await ws.send(json.dumps({"type": "generate", "id": "g", "request": CHAT}))
                while json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))["type"] != (
                        "generation.done"):
                    pass
            tracer = app.state.gateway.tracer
            assert await asyncio.to_thread(tracer.flush, WAIT_S)
    spans = [s for r in received for rs in r.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    assert len(spans) == 3 and {s.name for s in spans} == {"llm_request"}
    by_id = {attributes(s)["gen_ai.response.id"]: s for s in spans}
    chat = by_id[reply["id"]]
    assert chat.trace_id.hex() == TRACE_ID  # a child of the caller's span
    assert chat.parent_span_id.hex() == "00f067aa0ba902b7"
    timeline = reply["timeline"]
    assert chat.start_time_unix_nano == int(timeline["queued"] * 1e9)
    assert chat.end_time_unix_nano == int(timeline["finished"] * 1e9)
    assert [(e.name, e.time_unix_nano) for e in chat.events] == [
        ("scheduled", int(timeline["scheduled"] * 1e9)),
        ("first_token", int(timeline["first_token"] * 1e9))]
    attrs = attributes(chat)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert attrs["gen_ai.latency.time_to_first_token"] > 0
    assert attrs["pagedserve.preemptions"] == FAKE_COUNTS["num_preemptions"]
    assert attrs["pagedserve.spec_accepted_tokens"] == FAKE_COUNTS["num_spec_accepted_tokens"]
    others = [s for s in spans if s is not chat]
    assert all(s.trace_id.hex() != TRACE_ID and not s.parent_span_id for s in others)
    assert sorted(attributes(s)["gen_ai.operation.name"] for s in others) == [
        "chat", "text_completion"]
    resource = {kv.key: kv.value.string_value for kv in received[0].resource_spans[0].resource
                .attributes}
    assert resource["service.name"] == "pagedserve"


@pytest.mark.parametrize("endpoint, url", [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/custom/path", "https://otel.example/custom/path"),
])
def test_endpoint_base_or_full_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


def test_a_bad_endpoint_is_a_config_error() -> None:
    ns = build_parser().parse_args(["serve", "--otlp-traces-endpoint", "collector:4318"])
    with pytest.raises(ValueError, match="otlp-traces-endpoint"):
        check_args(ns)
