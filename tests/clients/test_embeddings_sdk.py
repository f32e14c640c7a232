"""/v1/embeddings, rerank and score on a real `pagedserve serve` of a tiny sentence-
transformers checkpoint, through the official `openai` SDK (float, and base64 decoded by the
SDK), LangChain's OpenAIEmbeddings and raw HTTP; references from sentence-transformers."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from langchain_openai import OpenAIEmbeddings
from sentence_transformers import SentenceTransformer
from tiny_embedder import embedder_dir
from tiny_server import metric, running_server, wait_idle

MODEL = "tiny-embed"
TEXTS = ["The cat sat on the mat.", "Paged attention keeps the KV cache in fixed blocks.",
         "A dog ran in the park", "Vectors of text"]


@pytest.fixture(scope="module")
def model_dir():
    return embedder_dir("mean", matryoshka=[32, 16])


@pytest.fixture(scope="module")
def st(model_dir) -> SentenceTransformer:
    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def url(model_dir) -> Iterator[str]:
    # NOTE: the tiny embedder replaces the tiny chat model; the later flags override the helper's
    with running_server("--model", str(model_dir), "--served-model-name", MODEL,
                        "--max-model-len", "128", "--num-gpu-blocks", "256",
                        "--max-num-batched-tokens", "64") as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.tensor(b, dtype=torch.float64),
                                                 dim=0).item()


def test_openai_sdk_float_and_base64(client, st):
    ref = st.encode(TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    # NOTE: without encoding_format the SDK asks for base64 and decodes it itself
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert floats.model == MODEL and floats.object == "list"
    for f, b, r in zip(floats.data, b64.data, ref, strict=True):
        assert len(f.embedding) == 64
        assert _cos(f.embedding, r) >= 0.9999
        assert b.embedding == pytest.approx(f.embedding, abs=1e-6)  # float32 on the wire


def test_token_id_inputs_and_dimensions(client, st):
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    ref = st.encode(TEXTS[:2])
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert _cos(one.data[0].embedding, ref[0]) >= 0.9999
    assert [_cos(d.embedding, r) >= 0.9999 for d, r in zip(many.data, ref, strict=True)] == \
        [True, True]
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16,
                                     encoding_format="float", user="someone")
    vec = short.data[0].embedding
    assert len(vec) == 16 and math.isclose(math.hypot(*vec), 1.0, rel_tol=1e-5)
    assert _cos(vec, ref[0][:16]) >= 0.9999  # truncated, then normalized


def test_langchain_openai_embeddings(url, st):
    # NOTE: check_embedding_ctx_length=False: otherwise LangChain sends tiktoken's ids (an
    # OpenAI vocabulary, and a download) instead of the text
    emb = OpenAIEmbeddings(model=MODEL, base_url=f"{url}/v1", api_key="unused",
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS[:3])
    query = emb.embed_query(TEXTS[3])
    ref = st.encode(TEXTS)
    for got, want in zip([*docs, query], ref, strict=True):
        assert _cos(got, want) >= 0.9999


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input[1]"),
    ({"input": ["text", [1, 2]]}, 400, "input"),
    ({"input": "word " * 200}, 400, "input"),
    ({"input": [[5] * 129]}, 400, "input"),
    ({"input": [10**6]}, 400, "input"),
    ({"input": "x", "dimensions": 24}, 400, "dimensions"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({}, 400, "input"),
])
def test_errors_name_the_field(url, body, status, param):
    reply = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] and error["code"]


def test_too_long_input_is_context_length_exceeded(url):
    reply = httpx.post(f"{url}/v1/embeddings", json={"input": "word " * 200}, timeout=60)
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_rerank_orders_by_the_reference_cosine(url, st):
    query = TEXTS[0]
    q, d = st.encode([query]), st.encode(TEXTS[1:])
    sims = [float(x) for x in st.similarity(q, d)[0]]  # cosine (the model's similarity_fn)
    # NOTE: documents sent worst first, so that the answer's order is the reverse of theirs
    docs = [TEXTS[1 + i] for i in sorted(range(3), key=lambda i: sims[i])]
    want = sorted(sims)
    order = [2, 1, 0]
    assert len(set(want)) == 3
    body = {"model": MODEL, "query": query,
            "documents": [docs[0], {"text": docs[1]}, docs[2]]}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = httpx.post(f"{url}{path}", json=body, timeout=60).json()
        assert [r["index"] for r in reply["results"]] == order
        for r in reply["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
            assert r["document"]["text"] == docs[r["index"]]
    top = httpx.post(f"{url}/v1/rerank", json={**body, "top_n": 2, "return_documents": False},
                     timeout=60).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])
    assert top["usage"]["total_tokens"] > 0


def test_score_pairs_match_the_reference(url, st):
    vecs = st.encode(TEXTS)
    sims = st.similarity(vecs, vecs)
    one_to_n = httpx.post(f"{url}/score", json={"model": MODEL, "text_1": TEXTS[0],
                                                "text_2": TEXTS[1:]}, timeout=60).json()
    assert [d["score"] for d in one_to_n["data"]] == pytest.approx(
        [float(sims[0, j]) for j in (1, 2, 3)], abs=1e-4)
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]},
                       timeout=60).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [float(sims[0, 2]), float(sims[1, 3])], abs=1e-4)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
])
def test_rerank_and_score_errors(url, path, body, param):
    reply = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_generation_still_served_and_blocks_balance(url, client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    client.embeddings.create(model=MODEL, input=TEXTS * 4, encoding_format="float")
    text = httpx.get(f"{url}/metrics").text
    free = [line for line in text.splitlines() if line.startswith("pagedserve_kv_blocks_free")]
    total = [line for line in text.splitlines() if line.startswith("pagedserve_kv_blocks_total")]
    assert free and total and free[0].split()[-1] == total[0].split()[-1], (free, total)


def _kv_balanced(url: str) -> bool:
    return metric(url, "pagedserve_kv_blocks_free") == metric(url, "pagedserve_kv_blocks_total")


def _finished(url: str) -> dict[str, float]:
    """The gateway's count of finished (engine) requests by finish reason."""
    found = re.findall(r'^pagedserve_requests_total\{finish_reason="(\w+)"\} (\S+)$',
                       httpx.get(f"{url}/metrics").text, re.M)
    return {reason: float(n) for reason, n in found}


def test_cancel_by_request_id_ends_an_embeddings_request(url, st):
    """An embeddings request is in the gateway's table under its `request_id`: the cancel
    route aborts its engine requests (512 inputs of 128 tokens: ~1000 steps of 64 tokens,
    about a second here, cancelled within a few ms), the client gets 500 `cancelled`, each
    engine request ends once, and the KV blocks balance."""
    n = 512
    inputs = [[10 + (7 * i + j) % 5000 for j in range(128)] for i in range(n)]
    before = _finished(url)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(httpx.post, f"{url}/v1/embeddings", timeout=60,
                           json={"input": inputs, "request_id": "emb-cancel"})
        while (cancel := httpx.post(f"{url}/v1/requests/emb-cancel/cancel")).status_code == 404:
            assert not call.done(), "it finished before the cancel found it"
            time.sleep(0.005)
        reply = call.result()
    assert cancel.json() == {"id": "emb-cancel", "object": "request.cancelled", "cancelled": True}
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "cancelled", reply.text
    assert reply.headers["x-should-retry"] == "false"
    assert wait_idle(url) == 0 and _kv_balanced(url)
    after = _finished(url)
    # NOTE: each engine request counted once: aborted, or (the first few, done before the
    # cancel arrived) finished
    assert sum(after.values()) - sum(before.values()) == n
    assert after.get("abort", 0) - before.get("abort", 0) > n - 32
    assert httpx.post(f"{url}/v1/requests/emb-cancel/cancel").status_code == 404
    again = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "request_id": "emb-cancel",
                                                     "encoding_format": "float"}, timeout=60)
    assert again.status_code == 200 and again.json()["id"] == "emb-cancel"
    assert _cos(again.json()["data"][0]["embedding"], st.encode(TEXTS[:1])[0]) >= 0.9999


def test_pagedserve_sdk_embeddings_rerank_score(url, st):
    from pagedserve_client import AsyncClient, BadRequestError, Client

    ref = st.encode(TEXTS)
    with Client(url, max_retries=0) as client:
        floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        b64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
        for f, b, r in zip(floats.data, b64.data, ref, strict=True):
            assert _cos(f.embedding, r) >= 0.9999
            assert b.embedding == pytest.approx(f.embedding, abs=1e-6)
        assert floats.usage.prompt_tokens > 0
        ranked = client.rerank(query=TEXTS[0], documents=TEXTS[1:], model=MODEL, top_n=2)
        want = [float(x) for x in st.similarity(ref[:1], ref[1:])[0]]
        assert [r.index for r in ranked.results] == sorted(range(3), key=lambda i: -want[i])[:2]
        assert ranked.results[0].document.text == TEXTS[1 + ranked.results[0].index]
        scores = client.score(text_1=TEXTS[0], text_2=TEXTS[1:])
        assert [s.score for s in scores.data] == pytest.approx(want, abs=1e-4)
        with pytest.raises(BadRequestError) as err:
            client.embeddings.create(input="x", dimensions=24)
        assert err.value.param == "dimensions"

    async def run() -> None:
        async with AsyncClient(url, max_retries=0) as client:
            out = await client.embeddings.create(input=TEXTS[:1])
            assert _cos(out.data[0].embedding, ref[0]) >= 0.9999
            ranked = await client.rerank(query=TEXTS[0], documents=[{"text": TEXTS[1]}])
            assert ranked.results[0].relevance_score == pytest.approx(want[0], abs=1e-4)
            pairs = await client.score(text_1=TEXTS[:2], text_2=TEXTS[2:])
            assert len(pairs.data) == 2

    import asyncio

    asyncio.run(run())
