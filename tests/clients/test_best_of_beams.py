"""`best_of` and beam search against a real server on the tiny Llama, checked against the
in-process `LLM` on the same checkpoint: best_of returns the n highest cumulative-logprob
samples of the seeded set (sample i uses seed + i, so `n=best_of` with the same seed is that
set), and the beams over SSE and over the WebSocket are the `LLM`'s beams, best first."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
import websockets
from tiny_server import MODEL_NAME, tiny_model_dir

from engine import LLM, SamplingParams

PROMPT = [1, *range(400, 420)]
MAX = 8


@pytest.fixture(scope="module")
def llm():
    """The server's engine settings, in this process (one thread, as the server's)."""
    threads = torch.get_num_threads()
    yield LLM(model=str(tiny_model_dir()), max_model_len=4096, num_gpu_blocks=1024,
              max_num_seqs=16, num_threads=1)
    torch.set_num_threads(threads)


def test_best_of_returns_the_most_likely_of_the_seeded_samples(server_url: str, llm) -> None:
    n, best_of, seed = 2, 6, 1234
    every = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        n=best_of, seed=seed, temperature=1.0, max_tokens=MAX, ignore_eos=True,
        logprobs=0))[0].outputs
    # each sample's summed logprob, from its sampled tokens' logprobs
    total = {c.index: sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True))
             for c in every}
    assert len(set(total.values())) == best_of  # no ties: one order
    ranked = sorted(every, key=lambda c: -total[c.index])
    want = [c.text for c in ranked[:n]]
    assert want != [c.text for c in ranked[-n:]]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": n, "best_of": best_of, "seed": seed,
            "temperature": 1.0, "max_tokens": MAX, "ignore_eos": True}
    reply = httpx.post(f"{server_url}/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in reply["choices"]] == list(range(n))
    assert [c["text"] for c in reply["choices"]] == want
    # the server's own full set is the same samples (the seeds reach it)
    full = httpx.post(f"{server_url}/v1/completions", timeout=120, json={
        **body, "n": best_of, "best_of": None}).json()
    assert [c["text"] for c in full["choices"]] == [c.text for c in every]


def _beams(llm, prompt: list[int], width: int) -> list[str]:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=width, use_beam_search=True, temperature=0.0, max_tokens=MAX))[0].outputs
    assert len({c.text for c in out}) == width
    return [c.text for c in out]


def test_beam_search_over_sse_equals_the_llm_beams(server_url: str, llm) -> None:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", f"{server_url}/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": PROMPT, "n": 3, "use_beam_search": True,
            "temperature": 0.0, "max_tokens": MAX, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c.get("finish_reason"):
                reasons[c["index"]] = c["finish_reason"]
    assert sorted(reasons) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == _beams(llm, PROMPT, 3)


def test_beam_search_over_the_websocket_equals_the_llm_beams(server_url: str, llm) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = httpx.post(f"{server_url}/tokenize", timeout=60, json={
        "model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}).json()["tokens"]
    request = {"model": MODEL_NAME, "messages": messages, "n": 3, "use_beam_search": True,
               "temperature": 0.0, "max_tokens": MAX}

    async def run() -> tuple[dict[int, str], dict]:
        url = server_url.replace("http://", "ws://") + "/v1/ws"
        texts: dict[int, str] = {}
        async with websockets.connect(url, subprotocols=["pagedserve.v1"]) as ws:
            assert json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] == "session.created"
            await ws.send(json.dumps({"type": "generate", "id": "b", "request": request}))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
                assert frame["type"] != "error", frame
                if frame["type"] == "generation.delta":
                    for c in frame["chunk"]["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + (
                            c["delta"].get("content") or "")
                elif frame["type"] == "generation.done":
                    return texts, frame

    texts, done = asyncio.run(run())
    assert done["status"] == "completed" and len(done["finish_reasons"]) == 3
    assert [texts.get(i, "") for i in range(3)] == _beams(llm, prompt, 3)
