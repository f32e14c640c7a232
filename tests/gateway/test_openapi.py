"""The gateway's OpenAPI document: valid, covering every route, and true of a real server
(Schemathesis fuzzes each operation under uvicorn with the scripted engine)."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from gateway_fakes import FakeEngine, serve
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.app import build_app
from gateway.model_registry import ModelRegistry
from gateway.model_specs import spec_of
from gateway.openapi import openapi_document
from gateway.settings import GatewaySettings
from ipc.config import EngineConfig

pytestmark = pytest.mark.timeout(120)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]
# NOTE: 20 generated cases per mode and route (66 routes: about 97 s at 30, the suite's largest
# share), beside each route's explicit cases; derandomized, so every run sends the same ones
SETTINGS = settings(max_examples=20, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])
RUNNING = "fuzz-running"  # a request the cancel operation's explicit case cancels
STREAM: list[str] = []  # a finished resumable stream the stream operations' cases resume


def _schema() -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(copy.deepcopy(openapi_document()))


OPERATIONS = [result.ok().label for result in _schema().get_all_operations()]
# NOTE: the stats stream never ends, so it cannot be fuzzed by request and response;
# tests/gateway/test_stats_stream.py checks its events against the document's schema
FUZZED = [label for label in OPERATIONS if label != "GET /v1/stats/stream"]


def test_document_is_valid_and_covers_every_route(fake_engine: FakeEngine) -> None:
    _schema().validate()  # against the OpenAPI 3.1 meta-schema
    # HEAD comes with every GET; `/` and /dashboard are pages; /static and /v1/ws are not
    # HTTP APIs.
    # a `{name:path}` parameter (model ids may hold `/`) is `{name}` in OpenAPI
    served = {f"{method} {route.path.replace(':path}', '}')}"
              for route in build_app(fake_engine).routes
              if isinstance(route, Route) and route.path not in ("/", "/dashboard")
              for method in (route.methods or set()) - {"HEAD"}}
    assert set(OPERATIONS) == served


async def test_served_without_a_key_like_health(fake_engine: FakeEngine) -> None:
    app = build_app(fake_engine, GatewaySettings(api_key="sekret"))
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.get("/openapi.json")
        assert (await http.get("/v1/models")).status_code == 401
    assert response.status_code == 200 and response.json() == openapi_document()


def _explicit_cases(operation: schemathesis.APIOperation,
                    stored: str | None) -> list[schemathesis.Case]:
    """The documented request examples, a cancel of the request that is running, and the
    stored response (GET, DELETE)."""
    if "{response_id}" in operation.path:
        return [operation.Case(path_parameters={"response_id": stored})]
    if "{model_id}" in operation.path:
        return [operation.Case(path_parameters={"model_id": "test-model"})]
    if "{stream_id}" in operation.path:
        return [operation.Case(path_parameters={"stream_id": STREAM[-1]})]
    if operation.path_parameters:
        return [operation.Case(path_parameters={"request_id": RUNNING})]
    body = openapi_document()["paths"][operation.path][operation.method.lower()].get(
        "requestBody")
    if body is None:
        return [operation.Case()]
    examples = body["content"]["application/json"]["examples"].values()
    return [operation.Case(body=e["value"], media_type="application/json") for e in examples]


def _fuzz(url: str, label: str, stored: str | None = None) -> Counter[str]:
    """Explicit cases, then valid and (where there is a body) invalid generated ones: every
    response must pass CHECKS. Returns how many of each status and media type came back."""
    method, path = label.split(" ", 1)
    operation = schemathesis.openapi.from_url(f"{url}/openapi.json")[path][method]
    seen: Counter[str] = Counter()
    session = requests.Session()

    def check(case: schemathesis.Case) -> None:
        response = case.call_and_validate(base_url=url, session=session, checks=CHECKS,
                                          timeout=10)
        media_type = response.headers.get("content-type", [""])[0].split(";")[0]
        seen[f"{response.status_code} {media_type}"] += 1

    for case in _explicit_cases(operation, stored):
        check(case)
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
    for mode in modes:

        @SETTINGS
        @given(case=operation.as_strategy(mode))
        def fuzz(case: schemathesis.Case) -> None:
            check(case)

        fuzz()
    return seen


def _models_app(fake_engine: FakeEngine, tokenizer_dir: Path) -> Starlette:
    """A gateway serving `small` (the example the model routes name) from several models'
    registry, with run-time management on: new models load as fake engines."""
    spec = spec_of("small", {"path": "/models/small"}, EngineConfig())
    registry = ModelRegistry([spec], lambda s: fake_engine if s is spec
                             else FakeEngine(tokenizer_dir))  # type: ignore[arg-type,return-value]
    return build_app(registry, GatewaySettings(model_management=True))


@pytest.mark.parametrize("label", FUZZED)
async def test_fuzz_against_the_document(fake_engine: FakeEngine, tokenizer_dir: Path,
                                         label: str) -> None:
    fake_engine.interval = 0.0
    # NOTE: the LoRA routes answer 404 unless run-time updating is on; "sql" is there to unload
    lora = GatewaySettings(enable_lora=True, allow_runtime_lora_updating=True,
                           lora_modules=("sql=/adapters/sql",))
    if " /models" in label:
        app = _models_app(fake_engine, tokenizer_dir)
    else:
        app = build_app(fake_engine, lora if "lora_adapter" in label else None)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        running = None
        if "{request_id}" in label:  # a request for the explicit case to cancel
            fake_engine.first_delay = 60.0
            running = asyncio.create_task(
                http.post("/v1/completions", json={"prompt": "x", "request_id": RUNNING}))
            while RUNNING not in app.state.gateway.generations:
                await asyncio.sleep(0.01)
        stored = None
        if "{response_id}" in label:  # a stored response for the explicit case
            reply = await http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2})
            stored = reply.json()["id"]
        if "{stream_id}" in label:  # a finished resumable stream, to resume and cancel
            body = {"prompt": "x", "max_tokens": 3, "stream": True, "resumable": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                STREAM.append(r.headers["x-stream-id"])
                await r.aread()
        seen = await asyncio.to_thread(_fuzz, url, label, stored)
        if running is not None:
            assert (await running).json()["choices"][0]["finish_reason"] == "abort"
    assert any(key.startswith("200 ") for key in seen), seen
    if label.endswith(("completions", "/v1/responses", "/v1/messages")):
        assert seen["200 application/json"] and seen["200 text/event-stream"], seen


def test_the_request_limits_are_in_the_document() -> None:
    schemas = openapi_document()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    stop_string, stop_list = chat["stop"]["anyOf"][:2]
    assert (stop_string["minLength"], stop_string["maxLength"]) == (1, 256)
    assert stop_list["maxItems"] == 16 and stop_list["items"]["maxLength"] == 256
    assert chat["stop_token_ids"]["anyOf"][0]["maxItems"] == 256
    assert chat["request_id"]["anyOf"][0]["maxLength"] == 256
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert sorted(roles) == ["assistant", "developer", "system", "tool", "user"]
