"""The gateway in front of a ModelRegistry of two scripted engines: each route (chat,
completions, Responses, Messages, WebSocket, tokenize) sends a request to the engine of the
model it names, with that model's context; other names are 404; an adapter name routes to its
parent; unloading a model aborts its running request (one terminal event) and 404s the rest."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.model_registry import ModelRegistry
from gateway.model_specs import spec_of
from gateway.service import GatewaySettings
from ipc.config import EngineConfig

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engines(tokenizer_dir: Path) -> dict[str, FakeEngine]:
    return {"a": FakeEngine(tokenizer_dir, max_model_len=256),
            "b": FakeEngine(tokenizer_dir, max_model_len=64)}


@pytest.fixture
def registry(engines: dict[str, FakeEngine]) -> ModelRegistry:
    specs = [spec_of(name, {"path": f"/models/{name}"}, EngineConfig()) for name in engines]
    return ModelRegistry(specs, lambda spec: engines[spec.name])  # type: ignore[arg-type,return-value]


def _sent(engines: dict[str, FakeEngine]) -> dict[str, int]:
    return {name: len(e.submitted) for name, e in engines.items()}


async def test_each_route_runs_on_the_model_it_names(engines: dict[str, FakeEngine],
                                                     registry: ModelRegistry) -> None:
    app = build_app(registry, GatewaySettings())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        bodies = {"/v1/chat/completions": {"messages": HI, "max_tokens": 2},
                  "/v1/completions": {"prompt": "hi", "max_tokens": 2},
                  "/v1/responses": {"input": "hi", "max_output_tokens": 2},
                  "/v1/messages": {"messages": HI, "max_tokens": 2}}
        for path, body in bodies.items():
            for name in ("b", "a"):
                before = _sent(engines)
                reply = await http.post(path, json={**body, "model": name})
                assert reply.status_code == 200, (path, reply.text)
                assert reply.json()["model"] == name
                after = _sent(engines)
                assert after[name] == before[name] + 1, (path, name)
                assert sum(after.values()) == sum(before.values()) + 1
            unknown = await http.post(path, json={**body, "model": "c"})
            assert unknown.status_code == 404, path
        no_model = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert no_model.json()["model"] == "a"  # the first model is the default
        # each model's own context: 100 tokens fit a (256), not b (64)
        long = {"prompt": [1] * 100, "max_tokens": 1}
        assert (await http.post("/v1/completions", json={**long, "model": "a"})).status_code \
            == 200
        too_long = await http.post("/v1/completions", json={**long, "model": "b"})
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        tokenized = await http.post("/tokenize", json={"model": "b", "prompt": "hi"})
        assert tokenized.json()["max_model_len"] == 64
        cards = (await http.get("/v1/models")).json()["data"]
        assert [(c["id"], c["max_model_len"]) for c in cards] == [("a", 256), ("b", 64)]
        metrics = (await http.get("/metrics")).text
        for name in ("a", "b"):
            assert f'vllm:kv_cache_usage_perc{{model_name="{name}"}}' in metrics
            assert f'vllm:e2e_request_latency_seconds_count{{model_name="{name}"}}' in metrics


async def test_websocket_generations_pick_their_model(engines: dict[str, FakeEngine],
                                                      registry: ModelRegistry) -> None:
    app = build_app(registry, GatewaySettings())
    async with serve(app) as url, websockets.connect(
            url.replace("http://", "ws://") + "/v1/ws", subprotocols=["pagedserve.v1"]) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for gen_id, model in (("1", "b"), ("2", "c")):
            request = {"model": model, "messages": HI, "max_tokens": 2}
            await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": request}))
        frames = []
        while not {"1", "2"} <= {f.get("id") for f in frames
                                 if f["type"] in ("generation.done", "error")}:
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    error = next(f for f in frames if f["type"] == "error")
    assert error["id"] == "2" and error["error"]["code"] == "model_not_found"
    assert _sent(engines) == {"a": 0, "b": 1}


async def test_an_adapter_name_runs_on_its_parent(engines: dict[str, FakeEngine],
                                                  registry: ModelRegistry) -> None:
    registry.add_alias("b-sql", "b")
    app = build_app(registry, GatewaySettings())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        reply = await http.post("/v1/completions", json={"model": "b-sql", "prompt": "hi",
                                                         "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "b-sql"
    assert _sent(engines) == {"a": 0, "b": 1}


async def test_unload_aborts_running_requests_then_404(engines: dict[str, FakeEngine],
                                                       registry: ModelRegistry) -> None:
    # NOTE: a token a second: the unload (in-process, milliseconds) comes between two tokens
    engines["b"].interval = 1.0
    app = build_app(registry, GatewaySettings(model_management=True))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        body = {"model": "b", "prompt": "hi", "max_tokens": 40, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data: "))
            unloaded = await http.post("/models/unload", json={"model": "b"})
            rest = [line async for line in lines if line.startswith("data: ")]
        assert unloaded.status_code == 200 and not engines["b"].ready
        events = [json.loads(e[6:]) for e in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        finished = [c["finish_reason"] for e in events for c in e["choices"]
                    if c["finish_reason"]]
        assert finished == ["abort"]
        gone = await http.post("/v1/completions", json={"model": "b", "prompt": "hi"})
        assert gone.status_code == 404
        assert [c["id"] for c in (await http.get("/v1/models")).json()["data"]] == ["a"]
        states = {r["id"]: r["status"]["value"] for r in (await http.get("/models")).json()["data"]}
        assert states == {"a": "loaded", "b": "unloaded"}
        again = await http.post("/models/load", json={"model": "b"})
        assert again.status_code == 200 and engines["b"].ready
        reply = await http.post("/v1/completions", json={"model": "b", "prompt": "hi",
                                                         "max_tokens": 2})
        assert reply.status_code == 200


async def test_management_routes_are_off_without_the_flag(registry: ModelRegistry,
                                                          fake_engine: FakeEngine) -> None:
    async with serve(build_app(registry, GatewaySettings(api_key="k"))) as url, \
            httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/models/load", json={"model": "a"})).status_code == 401
        off = await http.post("/models/unload", json={"model": "a"},
                              headers={"Authorization": "Bearer k"})
        assert off.status_code == 403
        assert off.json()["error"]["code"] == "model_management_disabled"
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/models")).status_code == 403  # one model, no registry
