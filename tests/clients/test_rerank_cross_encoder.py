"""/v1/rerank and /score on a real `pagedserve serve` of a tiny random cross-encoder
(Qwen3ForSequenceClassification, one label) against sentence-transformers' CrossEncoder on
the same checkpoint; what such a model refuses; and, last (it stops the module's server), a
SIGTERM drain that waits for a rerank request and aborts it at the deadline."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sentence_transformers import CrossEncoder
from tiny_cross_encoder import cross_encoder_dir
from tiny_server import metric, running_process

from ipc import exit_codes

MODEL = "tiny-rerank"
QUERY = "What is paged attention?"
# NOTE: the last document ends with the pad token, which HF's head skips
DOCS = ["The KV cache is kept in fixed-size blocks.", "A cat sat on the mat.",
        "Paged attention reads its keys and values block by block. " * 4,
        "Where is the cat? On the mat<|im_end|>"]
DRAIN_DEADLINE_S = 1.0
TOL = 1e-4  # NOTE: float32 on both sides; the server's CPU fast paths order sums differently


@pytest.fixture(scope="module")
def ce() -> CrossEncoder:
    return CrossEncoder(str(cross_encoder_dir("qwen3")), device="cpu")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, object]]:
    with running_process("--model", str(cross_encoder_dir("qwen3")), "--served-model-name",
                         MODEL, "--max-model-len", "256", "--num-gpu-blocks", "256",
                         "--max-num-batched-tokens", "16",
                         "--shutdown-timeout", str(DRAIN_DEADLINE_S)) as running:
        yield running


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


def test_rerank_matches_the_cross_encoder(url, ce):
    want = [float(s) for s in ce.predict([(QUERY, d) for d in DOCS])]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert min(abs(a - b) for i, a in enumerate(want) for b in want[i + 1:]) > 10 * TOL
    tokens = sum(len(ce.tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
    body = {"model": MODEL, "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == order
        for r in results:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOL)
            assert r["document"]["text"] == DOCS[r["index"]]
        assert reply.json()["usage"]["prompt_tokens"] == tokens
        assert reply.headers["x-request-id"] == reply.json()["id"]
    top = httpx.post(f"{url}/v1/rerank", json={**body, "top_n": 2, "return_documents": False,
                                               "request_id": "rr-1"}, timeout=60)
    assert [r["index"] for r in top.json()["results"]] == order[:2]
    assert all("document" not in r for r in top.json()["results"])
    assert top.json()["id"] == "rr-1"


def test_score_pairs_match_the_cross_encoder(url, ce):
    one_to_n = httpx.post(f"{url}/score", json={"model": MODEL, "text_1": QUERY,
                                                "text_2": DOCS}, timeout=60).json()
    assert [d["score"] for d in one_to_n["data"]] == pytest.approx(
        [float(s) for s in ce.predict([(QUERY, d) for d in DOCS])], abs=TOL)
    firsts = ["Where is the cat?", QUERY]
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": firsts, "text_2": DOCS[:2]},
                       timeout=60).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [float(s) for s in ce.predict(list(zip(firsts, DOCS[:2], strict=True)))], abs=TOL)


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/v1/embeddings", {"input": "x"}, 400, "model", "unsupported_model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model",
     "unsupported_model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model", "unsupported_model"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", "word " * 300]}, 400, "documents[1]",
     "context_length_exceeded"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, "query", "invalid_value"),
])
def test_what_a_cross_encoder_refuses(url, path, body, status, param, code):
    reply = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_sigterm_drain_waits_for_a_rerank_then_aborts_it(served):
    """The module's last test: it stops the server. A rerank of 512 long documents (~7700
    steps of 16 tokens: seconds) is in the gateway's table, so the drain waits for it until
    the deadline, aborts it (the client: 500 `cancelled`) and exits DRAIN_TIMEOUT."""
    url, proc = served
    docs = [f"Document {i}: " + "the KV cache is kept in blocks, " * 25 for i in range(512)]
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(httpx.post, f"{url}/v1/rerank",
                           json={"query": QUERY, "documents": docs}, timeout=60)
        while metric(url, "pagedserve_requests_running") == 0:
            assert not call.done(), call.result().status_code
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        reply = call.result()
        waited = time.monotonic() - t0
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "cancelled", reply.text
    assert DRAIN_DEADLINE_S - 0.2 < waited < DRAIN_DEADLINE_S + 3
    assert proc.wait(30) == exit_codes.DRAIN_TIMEOUT  # type: ignore[attr-defined]
