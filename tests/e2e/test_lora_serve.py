"""LoRA adapters over the real server (gateway + engine processes, a tiny base, random PEFT
adapters) with the official `openai` client: an adapter from --lora-modules and one loaded at
run time each answer as HF PEFT does, /v1/models lists them with their parent, the routes are
guarded by --api-key, a bad adapter is a clear 400 that leaves the server serving, unloading
frees the adapter's memory (the engine's counters on /metrics), and the prefix cache never
crosses adapters."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from lora_adapters import ADAPTERS, build_adapter, peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.serve_support import bundled_server

pytestmark = pytest.mark.timeout(600)

KEY = "lora-secret"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat by the " \
         "door and the bird sings in the tall green tree near the quiet river bank today"
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    return {name: build_adapter(tiny_model_dir, root / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters) -> Iterator[str]:
    with bundled_server("--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--max-model-len", "256", "--num-gpu-blocks", "64", "--enable-lora",
                        "--lora-modules", f"all={adapters['all']}", "--max-loras", "2",
                        "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                        "--api-key", KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _reference(tiny_model_dir, adapter_dir) -> str:
    """HF's greedy continuation of PROMPT (PEFT's with an adapter), as text."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = (peft_model(tiny_model_dir, adapter_dir) if adapter_dir is not None else
             AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=2)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW,
                                     temperature=0, extra_body={"ignore_eos": True})


def _metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def _wait_metric(server: str, name: str, want, timeout: float = 30.0) -> float:
    """The engine's counters arrive with its heartbeats: wait for `want(value)`."""
    deadline = time.monotonic() + timeout
    while True:
        value = _metric(server, name)
        if want(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _post(server: str, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server}/v1/{route}", json=body, headers=headers, timeout=60)


def test_adapter_from_the_command_line(client, server, tiny_model_dir, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "all"}
    assert cards["all"].model_extra["parent"] == "tiny"
    assert cards["all"].model_extra["root"] == str(adapters["all"])
    base, adapted = _complete(client, "tiny"), _complete(client, "all")
    assert adapted.model == "all"
    assert base.choices[0].text == _reference(tiny_model_dir, None)
    assert adapted.choices[0].text == _reference(tiny_model_dir, adapters["all"])
    assert adapted.choices[0].text != base.choices[0].text
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "nope")
    assert err.value.code == "model_not_found"


def test_load_at_run_time_bad_adapters_and_unload(client, server, tiny_model_dir, adapters,
                                                  tmp_path):
    body = {"lora_name": "qv", "lora_path": str(adapters["qv"])}
    assert _post(server, "load_lora_adapter", body, key=None).status_code == 401
    assert _metric(server, "pagedserve_lora_adapters") == 1
    bytes_one = _wait_metric(server, "pagedserve_lora_cpu_bytes", lambda v: v > 0)
    r = _post(server, "load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert "qv" in {m.id for m in client.models.list().data}
    assert _complete(client, "qv").choices[0].text == _reference(tiny_model_dir, adapters["qv"])
    assert _wait_metric(server, "pagedserve_lora_adapters", lambda v: v == 2) == 2
    bytes_two = _wait_metric(server, "pagedserve_lora_cpu_bytes", lambda v: v > bytes_one)
    assert bytes_two > bytes_one
    # refused by name, the server keeps serving
    for name, path, words in [("empty", str(tmp_path), "has no adapter_config.json"),
                              ("mlp", str(adapters["mlp"]), "has rank 16, above"),
                              ("qv", str(adapters["qv"]), "already been loaded")]:
        r = _post(server, "load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
    r = _post(server, "load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert _complete(client, "all").choices[0].text == _reference(tiny_model_dir,
                                                                   adapters["all"])
    # unload frees its host copy and its slot
    slots = _metric(server, "pagedserve_lora_slots_used")
    assert _post(server, "unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
    assert _wait_metric(server, "pagedserve_lora_cpu_bytes", lambda v: v == bytes_one) == \
        bytes_one
    assert _metric(server, "pagedserve_lora_slots_used") == slots - 1
    assert _metric(server, "pagedserve_lora_adapters") == 1
    assert "qv" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "qv")
    r = _post(server, "unload_lora_adapter", {"lora_name": "qv"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_prefix_cache_never_crosses_adapters(client):
    prompt = "Once more with feeling: " + PROMPT  # its own blocks, not the other tests'

    def cached(model: str) -> int:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        details = r.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    first, other, again = cached("tiny"), cached("all"), cached("all")
    assert (first, other) == (0, 0)
    assert again > 0 and cached("tiny") == again  # each its own adapter's blocks
