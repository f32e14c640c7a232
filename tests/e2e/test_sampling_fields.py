"""Each vLLM sampling field of the HTTP API reaches the real engine and changes what it does:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `priority`, `cache_salt`,
`stop_token_ids`, over `pagedserve serve` on the bundled model (the gateway tests' scripted
engine ignores them)."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serve_support import bundled_server

PROMPT = "The history of the printing press begins in"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # NOTE: one running request at a time, so that later ones queue and priority decides;
    # a32 numerics: min_tokens is checked on a greedy reply that ends (stop) within 40
    # tokens, which a32's (HF's) tokens do and a8's do not
    with bundled_server("--max-model-len", "512", "--num-gpu-blocks", "128",
                        "--max-num-seqs", "1", "--quantization-numerics", "a32") as (base, _):
        yield base


@functools.cache
def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(url: str, **body) -> dict:
    body = {"model": _model(url), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(url: str, **body) -> str:
    return _complete(url, **body)["choices"][0]["text"]


def _gauges(url: str) -> tuple[float, float]:
    """(running, waiting) in the engine, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = [re.search(rf"^pagedserve_requests_{name} (\S+)$", text, re.M)
             for name in ("running", "waiting")]
    assert all(found), text
    return float(found[0].group(1)), float(found[1].group(1))


def test_top_k_and_min_p_narrow_sampling_to_the_greedy_token(url: str) -> None:
    greedy = _text(url)
    hot = {"temperature": 1.5, "seed": 3}
    assert _text(url, **hot) != greedy  # a hot sample wanders off the greedy path...
    assert _text(url, **hot, top_k=1) == greedy  # ...unless only the top token is left
    assert _text(url, **hot, min_p=1.0) == greedy  # min_p 1: only tokens as likely as the top


def test_repetition_penalty_changes_greedy_output(url: str) -> None:
    body = {"prompt": "one two three one two three one two three", "max_tokens": 16}
    assert _text(url, **body, repetition_penalty=2.0) != _text(url, **body)


def test_min_tokens_holds_back_the_end_token(url: str) -> None:
    def chat(**extra) -> dict:
        body = {"model": _model(url), "messages": CHAT, "max_tokens": 60, "temperature": 0, **extra}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    short = chat()
    assert short["choices"][0]["finish_reason"] == "stop"
    n = short["usage"]["completion_tokens"]
    assert n < 40
    longer = chat(min_tokens=n + 10)
    assert longer["usage"]["completion_tokens"] >= n + 10


def test_stop_token_ids_end_the_output_at_that_token(url: str, bundled_tokenizer_dir) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundled_tokenizer_dir / "tokenizer.json"))
    greedy = _complete(url)["choices"][0]
    assert greedy["finish_reason"] == "length"
    ids = tok.encode(PROMPT + greedy["text"], add_special_tokens=False).ids
    prompt_len = len(tok.encode(PROMPT, add_special_tokens=False).ids)
    stop_id = ids[prompt_len + 4]  # the fifth generated token
    assert stop_id not in ids[prompt_len:prompt_len + 4]
    stopped = _complete(url, stop_token_ids=[stop_id])["choices"][0]
    assert stopped["finish_reason"] == "stop"
    # NOTE: the stop token's own text is dropped, as vLLM does (ipc.text.ChoiceText)
    assert stopped["text"] == tok.decode(ids[prompt_len:prompt_len + 4])
    assert len(stopped["text"]) < len(greedy["text"])


def test_cache_salt_separates_prefix_caches(url: str) -> None:
    prompt = "Shared prefix for the cache salt test. " * 6  # several full blocks
    def cached(**extra) -> int:
        usage = _complete(url, prompt=prompt, max_tokens=2, **extra)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    cached()  # warm the unsalted prefix
    assert cached() > 0
    assert cached(cache_salt="tenant-a") == 0  # a salt shares nothing with the unsalted copy
    assert cached(cache_salt="tenant-a") > 0  # ...but its own second request hits
    assert cached(cache_salt="tenant-b") == 0


def test_priority_orders_the_queue(url: str) -> None:
    """With one running slot: a long request runs, then `late` (priority 0) and `urgent`
    (priority -1, sent after it) queue; `urgent` is scheduled first (lower runs earlier)."""
    results: dict[str, dict] = {}

    def send(name: str, **extra) -> None:
        results[name] = _complete(url, max_tokens=120 if name == "long" else 4, **extra)

    threads = [threading.Thread(target=send, args=("long",))]
    threads[0].start()
    deadline = time.monotonic() + 60
    for name, priority, want in (("late", 0, (1, 0)), ("urgent", -1, (1, 1)), (None, 0, (1, 2))):
        while _gauges(url) != want:  # long running alone, then one, then two queued behind it
            assert time.monotonic() < deadline, f"never reached {want} running, waiting"
            time.sleep(0.02)
        if name is not None:
            threads.append(threading.Thread(target=send, args=(name,),
                                            kwargs={"priority": priority}))
            threads[-1].start()
    assert "long" not in results, "the long request ended before both others queued"
    for t in threads:
        t.join(120)
    scheduled = {k: v["timeline"]["scheduled"] for k, v in results.items()}
    assert scheduled["long"] < scheduled["urgent"] < scheduled["late"], scheduled
