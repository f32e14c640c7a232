"""The LoRA routes' refusals and the adapter registry at the gateway (a scripted engine): the
routes are off unless run-time updating is allowed (flag or vLLM's environment variable),
refused while LoRA is off, guarded by --api-key; `model` naming an adapter reaches the engine
as its lora_name; /v1/models cards carry vLLM's root and parent."""

from __future__ import annotations

import httpx
import openai
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.lora_registry import RUNTIME_ENV
from gateway.settings import GatewaySettings

LOAD = {"lora_name": "a", "lora_path": "/nowhere"}


def _app(engine: FakeEngine, **settings: object):
    return build_app(engine, GatewaySettings(**settings))  # type: ignore[arg-type]


async def test_routes_refused_unless_allowed(fake_engine, monkeypatch):
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    async with serve(_app(fake_engine, enable_lora=True)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            r = await http.post(f"/v1/{route}", json=LOAD)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "runtime_lora_updating_disabled"
            assert RUNTIME_ENV in r.json()["error"]["message"]
    monkeypatch.setenv(RUNTIME_ENV, "True")
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/load_lora_adapter", json=LOAD)  # allowed, but LoRA is off
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_disabled"


async def test_guarded_and_checked(fake_engine):
    app = _app(fake_engine, enable_lora=True, allow_runtime_lora_updating=True, api_key="k")
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/load_lora_adapter", json=LOAD)).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": ""}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("lora_name", "lora_path")
        r = await http.post("/v1/load_lora_adapter", headers=auth,
                            json={"lora_name": "test-model", "lora_path": "/x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_model_picks_the_adapter(fake_engine):
    app = _app(fake_engine, enable_lora=True, lora_modules=("sql=/adapters/sql",))
    async with serve(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        cards = {m.id: m.model_extra for m in (await client.models.list()).data}
        assert cards["sql"] == {**cards["sql"], "root": "/adapters/sql", "parent": "test-model"}
        assert cards["test-model"]["parent"] is None
        r = await client.completions.create(model="sql", prompt="hi", max_tokens=2)
        assert r.model == "sql"
        await client.completions.create(model="test-model", prompt="hi", max_tokens=2)
        assert [m.lora_name for m in fake_engine.submitted] == ["sql", None]
        try:
            await client.completions.create(model="other", prompt="hi", max_tokens=2)
        except openai.NotFoundError as exc:
            assert exc.code == "model_not_found"
        else:
            raise AssertionError("an unknown model was served")
