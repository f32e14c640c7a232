"""The gateway in front of a ModelRegistry of two scripted engines: each route (chat,
completions, Responses, Messages, WebSocket, tokenize) sends a request to the engine of the
model it names, with that model's context; other names are 404; an adapter name routes to its
parent's engine with its lora_name, and loads there by `base_model_name`; unloading a model
aborts its running request (one terminal event), 404s the rest and forgets its adapters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest
import websockets
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.model_registry import ModelRegistry
from gateway.model_specs import spec_of
from gateway.settings import GatewaySettings
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


def _adapted(engines: dict[str, FakeEngine]) -> ModelRegistry:
    """a with its adapter a-sql (named at start), b with LoRA on and no adapter yet."""
    engines["a"].lora_names = {"a-sql"}
    specs = [spec_of("a", {"path": "/models/a", "enable_lora": True,
                           "lora_modules": ["a-sql=/adapters/sql"]}, EngineConfig()),
             spec_of("b", {"path": "/models/b", "enable_lora": True}, EngineConfig())]
    return ModelRegistry(specs, lambda spec: engines[spec.name])  # type: ignore[arg-type,return-value]


async def test_adapters_run_on_their_parent_and_load_with_base_model_name(
        engines: dict[str, FakeEngine]) -> None:
    app = build_app(_adapted(engines), GatewaySettings(allow_runtime_lora_updating=True,
                                                       model_management=True))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def complete(model: str) -> httpx.Response:
            return await http.post("/v1/completions", json={"model": model, "prompt": "hi",
                                                            "max_tokens": 2})

        async def cards() -> dict[str, dict]:
            return {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}

        reply = await complete("a-sql")
        assert reply.status_code == 200 and reply.json()["model"] == "a-sql"
        assert [(m.lora_name, len(engines["b"].submitted)) for m in engines["a"].submitted] \
            == [("a-sql", 0)]  # a's engine, with the adapter; b's never saw it
        assert (await complete("b-sql")).status_code == 404
        assert {k: (c["parent"], c["root"]) for k, c in (await cards()).items()} == {
            "a": (None, None), "a-sql": ("a", "/adapters/sql"), "b": (None, None)}
        engines["a"].stats = msgspec.structs.replace(engines["a"].stats, lora_adapters=1)
        metrics = (await http.get("/metrics")).text  # each model's own engines' count
        for name, count in (("a", 1), ("b", 0)):
            assert f'pagedserve_lora_adapters{{model_name="{name}"}} {count}.0' in metrics
        load = {"lora_name": "b-sql", "lora_path": "/adapters/b-sql"}
        asked = await http.post("/v1/load_lora_adapter", json=load)
        assert asked.status_code == 400, asked.text  # both run LoRA: which one?
        assert asked.json()["error"]["param"] == "base_model_name"
        for parent, status, param in (("c", 404, "base_model_name"), ("a-sql", 404,
                                      "base_model_name")):
            r = await http.post("/v1/load_lora_adapter", json={**load, "base_model_name": parent})
            assert (r.status_code, r.json()["error"]["param"]) == (status, param)
        for name in ("a", "a-sql"):  # a model's name, or another model's adapter's
            r = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": name, "lora_path": "/x", "base_model_name": "b"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name"), name
        loaded = await http.post("/v1/load_lora_adapter", json={**load, "base_model_name": "b"})
        assert loaded.status_code == 200, loaded.text
        assert (engines["a"].lora_names, engines["b"].lora_names) == ({"a-sql"}, {"b-sql"})
        assert (await cards())["b-sql"]["parent"] == "b"
        assert (await complete("b-sql")).status_code == 200
        assert engines["b"].submitted[-1].lora_name == "b-sql"
        # unload finds the parent by name; unloading the model forgets its adapters
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a-sql"})
        assert r.status_code == 200 and engines["a"].lora_names == set()
        assert (await http.post("/models/unload", json={"model": "b"})).status_code == 200
        assert set(await cards()) == {"a"}
        assert (await complete("b-sql")).status_code == 404
        # the only model with LoRA now: base_model_name may be left out
        again = await http.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 200 and engines["a"].lora_names == {"b-sql"}
        assert (await cards())["b-sql"]["parent"] == "a"


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
