"""Several models behind one real gateway (`--config`, two tiny checkpoints of different seeds
and shapes): each answers under its own name with the greedy tokens HF transformers gives for
that checkpoint; other names are 404 on every generation route, in the route's error shape; a
data-parallel model keeps both its engines working and its prefix cache hit; one model is
unloaded (its engine PIDs gone, its in-flight stream ended by one terminal event) and reloaded.
LoRA adapters of each model (random PEFT ones, per checkpoint) answer as HF PEFT does on their
own parent, load at run time by `base_model_name`, and go with their model when it unloads.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pagedserve_client as ps
import pytest
from lora_adapters import ADAPTERS, build_adapter, peft_model
from tiny_llama import build_tiny_llama

from tests.e2e.serve_support import ROOT, free_port, wait_health

pytestmark = pytest.mark.timeout(900)

KEY = "models-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767]  # token ids, any will do
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, bundled_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("several-models")
    # NOTE: untied embeddings keep a random model from echoing one token
    return {
        "alpha": build_tiny_llama(root / "alpha", bundled_tokenizer_dir, seed=1,
                                  tie_word_embeddings=False, max_position_embeddings=1024),
        "beta": build_tiny_llama(root / "beta", bundled_tokenizer_dir, seed=2, hidden_size=96,
                                 intermediate_size=192, num_hidden_layers=3,
                                 num_attention_heads=6, num_key_value_heads=3,
                                 tie_word_embeddings=False, max_position_embeddings=1024),
    }


@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path]) -> dict[str, Path]:
    """A random PEFT adapter of each checkpoint (their shapes differ): name -> directory."""
    made = {"alpha-all": ("alpha", "all"), "beta-qv": ("beta", "qv")}
    return {name: build_adapter(checkpoints[base], checkpoints[base].parent / name, seed=i,
                                **ADAPTERS[kind])
            for i, (name, (base, kind)) in enumerate(made.items())}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path], adapters: dict[str, Path]) -> dict[str, str]:
    """Each checkpoint's greedy continuation of PROMPT_IDS, by HF transformers, and each
    adapter's on its own parent, by HF PEFT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for name, path in checkpoints.items()}
    models |= {name: peft_model(checkpoints[name.split("-")[0]], path)
               for name, path in adapters.items()}
    out = {}
    for name, model in models.items():
        with torch.no_grad():
            ids = model.generate(input_ids=torch.tensor([PROMPT_IDS]), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0]
        tok = AutoTokenizer.from_pretrained(checkpoints[name.split("-")[0]])
        out[name] = tok.decode(ids[len(PROMPT_IDS):], skip_special_tokens=True)
    assert len(set(out.values())) == len(out), f"each must answer differently: {out}"
    return out


@pytest.fixture(scope="module")
def url(checkpoints: dict[str, Path], adapters: dict[str, Path],
        tmp_path_factory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("config") / "models.toml"
    config.write_text(f'[models.alpha]\npath = "{checkpoints["alpha"]}"\n'
                      'data_parallel_size = 2\nenable_lora = true\nmax_loras = 2\n'
                      f'lora_modules = [{{name = "alpha-all", path = "{adapters["alpha-all"]}"}}]'
                      '\n\n'
                      f'[models.beta]\npath = "{checkpoints["beta"]}"\nmax_model_len = 512\n'
                      'enable_lora = true\n')
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--config",
         str(config), "--max-model-len", "1024", "--num-gpu-blocks", "256", "--max-num-seqs",
         "8", "--num-threads", "1", "--api-key", KEY, "--enable-model-management",
         "--allow-runtime-lora-updating",
         "--shutdown-timeout", "2", "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_health(base, 200, 300)
        _wait_loaded(base, {"alpha", "beta"})
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _models(url: str) -> dict[str, dict]:
    rows = httpx.get(f"{url}/models", headers=AUTH, timeout=30).json()["data"]
    return {r["id"]: r for r in rows}


def _wait_loaded(url: str, names: set[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loaded = {n for n, r in _models(url).items() if r["status"]["value"] == "loaded"}
        if names <= loaded:
            return
        assert time.monotonic() < deadline, f"never loaded: {names - loaded}"
        time.sleep(0.3)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_each_model_answers_under_its_own_name(url: str, references: dict[str, str]) -> None:
    client = _client(url)
    for name in ("alpha", "beta"):
        assert _greedy(client, name) == references[name], name
    chat = client.chat.completions.create(model="beta", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "beta" and chat.choices[0].message.content is not None
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"alpha", "alpha-all", "beta"}
    assert (cards["alpha"].max_model_len, cards["beta"].max_model_len) == (1024, 512)
    # each model's own context: a prompt that fits alpha is too long for beta
    long = {"prompt": [PROMPT_IDS[0]] * 600, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={**long, "model": "alpha"}).status_code == 200
    too_long = httpx.post(f"{url}/v1/completions", headers=AUTH, json={**long, "model": "beta"})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("alpha", "beta"):
        assert re.search(rf'^vllm:request_success_total{{finished_reason="length",'
                         rf'model_name="{name}"}} [1-9]', metrics, re.M), name
        assert re.search(rf'^vllm:num_requests_running{{model_name="{name}"}} ', metrics, re.M)


def test_an_unknown_model_is_404_on_every_route(url: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": messages}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/tokenize", {"prompt": "hi"})):
        reply = httpx.post(f"{url}{path}", headers=AUTH, json={**body, "model": "gamma"})
        assert reply.status_code == 404, path
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model"), path
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as claude, \
            pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="gamma", max_tokens=4, messages=messages)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "gamma" in caught.value.body["error"]["message"]


def _lora(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", headers=AUTH, json=body, timeout=120)


def test_adapters_answer_on_their_parent_and_load_by_base_model_name(
        url: str, references: dict[str, str], adapters: dict[str, Path]) -> None:
    client = _client(url)
    card = {m.id: m for m in client.models.list().data}["alpha-all"]
    assert (card.model_extra["parent"], card.model_extra["root"]) == \
        ("alpha", str(adapters["alpha-all"]))
    assert _greedy(client, "alpha-all") == references["alpha-all"]
    with pytest.raises(openai.NotFoundError) as unknown:
        _greedy(client, "beta-qv")  # not loaded yet: no model has it
    assert unknown.value.code == "model_not_found"
    body = {"lora_name": "beta-qv", "lora_path": str(adapters["beta-qv"])}
    which = _lora(url, "load_lora_adapter", body)  # both models run with LoRA
    assert which.status_code == 400 and which.json()["error"]["param"] == "base_model_name"
    loaded = _lora(url, "load_lora_adapter", {**body, "base_model_name": "beta"})
    assert loaded.status_code == 200, loaded.text
    card = {m.id: m for m in client.models.list().data}["beta-qv"]
    assert card.model_extra["parent"] == "beta" and card.max_model_len == 512
    assert _greedy(client, "beta-qv") == references["beta-qv"]
    assert _greedy(client, "beta") == references["beta"]
    deadline = time.monotonic() + 30  # the engines' counts come with their heartbeats
    while _metric(httpx.get(f"{url}/metrics"), "pagedserve_lora_adapters", "beta") != 1:
        assert time.monotonic() < deadline, "beta's adapter never counted"
        time.sleep(0.2)
    # alpha's two engines hold alpha-all each; beta's adapter is not theirs
    assert _metric(httpx.get(f"{url}/metrics"), "pagedserve_lora_adapters", "alpha") == 2


async def _engines_seen(http: httpx.AsyncClient, seen: list[dict]) -> None:
    async with http.stream("GET", "/v1/stats/stream", headers=AUTH) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                seen.extend(data if isinstance(data, list) else [data])


async def test_a_data_parallel_model_uses_both_engines_and_its_prefix_cache(url: str) -> None:
    names = {"alpha engine 0", "alpha engine 1"}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as http:
        seen: list[dict] = []
        reader = asyncio.create_task(_engines_seen(http, seen))
        try:
            deadline = time.monotonic() + 60
            while not (seen and names <= {e["engine"] for e in seen[-1]["engines"]}):
                assert time.monotonic() < deadline, "the stream never listed alpha's engines"
                await asyncio.sleep(0.2)
            body = {"model": "alpha", "prompt": "Once upon a time", "max_tokens": 300,
                    "ignore_eos": True}
            load = [asyncio.create_task(http.post("/v1/completions", json={**body, "seed": i}))
                    for i in range(4)]
            busy: set[str] = set()
            while busy != names and time.monotonic() < deadline + 120:
                await asyncio.sleep(0.5)
                busy = {e["engine"] for s in seen for e in s["engines"]
                        if e["engine"] in names and e["running"] > 0}
            assert all(r.status_code == 200 for r in await asyncio.gather(*load))
            assert busy == names
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        hits = _metric(await http.get("/metrics"), "vllm:prefix_cache_hits_total", "alpha")
        shared = {"model": "alpha", "prompt": PROMPT_IDS * 8, "max_tokens": 1}
        for _ in range(2):  # NOTE: the router sends the second to the engine holding it
            assert (await http.post("/v1/completions", json=shared)).status_code == 200
        after = _metric(await http.get("/metrics"), "vllm:prefix_cache_hits_total", "alpha")
        assert after - hits >= 64  # the prompt's full blocks (72 tokens: 4 blocks of 16)


def _metric(response: httpx.Response, name: str, model: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{model_name="{model}"}} (\S+)$', response.text,
                      re.M)
    assert match, (name, model)
    return float(match.group(1))


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_unload_ends_in_flight_requests_and_frees_the_engine_then_reload(
        url: str, references: dict[str, str], adapters: dict[str, Path]) -> None:
    before = _models(url)["beta"]
    assert len(before["pids"]) == 1 and before["resident_bytes"] > 0
    resident = _metric(httpx.get(f"{url}/metrics"), "pagedserve_engine_resident_bytes", "beta")
    assert resident > 0
    assert all(_alive(pid) for pid in before["pids"])
    assert httpx.post(f"{url}/models/unload", json={"model": "beta"}).status_code == 401
    events: list[str] = []
    body = {"model": "beta", "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json=body,
                      timeout=120) as stream:
        lines = stream.iter_lines()
        events += [next(line for line in lines if line.startswith("data: "))]
        unloaded = httpx.post(f"{url}/models/unload", headers=AUTH, json={"model": "beta"},
                              timeout=120)
        events += [line for line in lines if line.startswith("data: ")]
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json()["pids"] == before["pids"]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    terminal = [p for p in payloads if "error" in p
                or any(c.get("finish_reason") for c in p.get("choices", []))]
    assert len(terminal) == 1, terminal
    assert not any(_alive(pid) for pid in before["pids"])  # the process has exited
    assert _models(url)["beta"]["status"]["value"] == "unloaded"
    metrics = httpx.get(f"{url}/metrics").text  # its engines' memory and gauges: not counted
    for name in ("pagedserve_engine_resident_bytes", "vllm:num_requests_running"):
        assert f'{name}{{model_name="beta"}}' not in metrics
        assert f'{name}{{model_name="alpha"}}' in metrics
    gone = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"model": "beta",
                                                                     "prompt": "hi"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    client = _client(url)
    assert {m.id for m in client.models.list().data} == {"alpha", "alpha-all"}  # beta-qv: gone
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "beta-qv")
    assert _greedy(client, "alpha") == references["alpha"]  # the other model serves on
    # the one model with LoRA now: base_model_name may be left out (alpha's own adapter again)
    second = {"lora_name": "alpha-again", "lora_path": str(adapters["alpha-all"])}
    assert _lora(url, "load_lora_adapter", second).status_code == 200
    assert _greedy(client, "alpha-again") == references["alpha-all"]
    assert _lora(url, "unload_lora_adapter", {"lora_name": "alpha-again"}).status_code == 200

    reloaded = httpx.post(f"{url}/models/load", headers=AUTH, json={"model": "beta"},
                          timeout=300)
    assert reloaded.status_code == 200, reloaded.text
    assert set(reloaded.json()["pids"]).isdisjoint(before["pids"])
    assert _greedy(client, "beta") == references["beta"]
    assert "beta-qv" not in {m.id for m in client.models.list().data}  # loaded at run time
    again = httpx.post(f"{url}/models/load", headers=AUTH, json={"model": "beta"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "model_already_loaded"


def test_the_sdk_loads_a_new_model_with_engine_options(url: str, checkpoints: dict[str, Path],
                                                       references: dict[str, str],
                                                       adapters: dict[str, Path]) -> None:
    path = str(checkpoints["alpha"])
    with ps.Client(url, api_key=KEY, max_retries=0, timeout=300) as sdk:
        with pytest.raises(ps.BadRequestError) as bad:
            sdk.models.load("gamma", path=path, max_model_len="long")
        assert bad.value.param == "max_model_len"
        with pytest.raises(ps.ConflictError) as taken:  # alpha's adapter's name
            sdk.models.load("gamma", path=path, enable_lora=True,
                            lora_modules=[f"alpha-all={adapters['alpha-all']}"])
        assert (taken.value.code, taken.value.param) == ("name_in_use", "lora_modules")
        loaded = sdk.models.load("gamma", path=path, max_model_len=256, enable_lora=True,
                                 lora_modules=[f"gamma-all={adapters['alpha-all']}"])
        assert loaded.success and loaded.model == "gamma" and len(loaded.pids) == 1
        cards = {m.id: m for m in sdk.models.list().data}
        assert cards["gamma"].max_model_len == 256
        assert cards["gamma-all"].parent == "gamma"
        assert _greedy(_client(url), "gamma-all") == references["alpha-all"]  # alpha's weights
        states = {s.id: s for s in sdk.models.states()}
        assert states["gamma"].status.value == "loaded"
        assert states["gamma"].pids == loaded.pids and states["gamma"].resident_bytes > 0
        assert _greedy(_client(url), "gamma") == references["alpha"]  # alpha's weights
        unloaded = sdk.models.unload("gamma")
        assert unloaded.pids == loaded.pids
        assert not any(_alive(pid) for pid in loaded.pids)
        assert not {"gamma", "gamma-all"} & {m.id for m in sdk.models.list().data}
        assert {s.id: s for s in sdk.models.states()}["gamma"].status.value == "unloaded"
        with pytest.raises(ps.NotFoundError):
            sdk.models.unload("gamma")
