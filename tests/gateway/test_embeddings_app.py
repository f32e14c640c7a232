"""/v1/embeddings, rerank and score against the scripted engine: what reaches the engine, a
client that leaves aborts every engine request, an engine failure is a 500 in OpenAI's shape,
and pooling requests in the gateway's table: the cancel route ends them, a drain waits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.service import Gateway
from gateway.serving import _Drainer
from ipc.messages import TokenDelta
from ipc.pooling import PoolingInfo
from ipc.sd_notify import Notifier


async def test_requests_reach_the_engine_as_pooling_requests(fake_engine: FakeEngine) -> None:
    fake_engine.info.pooling = PoolingInfo(dimensions=8, is_matryoshka=True)  # type: ignore[union-attr]
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        reply = await http.post("/v1/embeddings", json={
            "input": [[4, 5], [5, 6, 7]], "dimensions": 4, "normalize": False, "priority": 2})
        assert reply.status_code == 200, reply.text
        assert [d["embedding"][0] for d in reply.json()["data"]] == [2.0, 3.0]  # prompt sizes
    sent = fake_engine.submitted
    assert [m.prompt_token_ids for m in sent][1] == [5, 6, 7]
    assert all(m.sampling.pooling is not None and m.sampling.pooling.dimensions == 4
               and m.sampling.pooling.normalize is False and m.priority == 2 for m in sent)
    assert reply.json()["usage"]["prompt_tokens"] == sum(len(m.prompt_token_ids) for m in sent)


@pytest.mark.parametrize(("path", "body", "count"), [
    ("/v1/embeddings", {"input": ["one", "two", "three"]}, 3),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, 3),
    ("/score", {"text_1": "q", "text_2": ["a", "b"]}, 3)])
async def test_a_client_that_leaves_aborts_every_engine_request(
        fake_engine: FakeEngine, path: str, body: dict, count: int) -> None:
    fake_engine.interval = 30.0
    async with serve(build_app(fake_engine)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(http.post(path, json=body), 0.5)
        for _ in range(100):
            if len(set(fake_engine.aborted)) == count:
                break
            await asyncio.sleep(0.02)
    assert set(fake_engine.aborted) == {m.request_id for m in fake_engine.submitted}
    assert len(fake_engine.submitted) == count


async def test_engine_failure_is_a_500_in_openai_shape(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 30.0
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        call = asyncio.create_task(http.post("/v1/embeddings", json={"input": "x"}))
        while not fake_engine.submitted:
            await asyncio.sleep(0.01)
        fake_engine.kill()
        reply = await call
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "engine_error"


async def test_an_engine_that_cannot_pool_is_a_400(fake_engine: FakeEngine) -> None:
    fake_engine.info.pooling = None  # type: ignore[union-attr]
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        for path, body in (("/v1/embeddings", {"input": "x"}),
                           ("/v1/rerank", {"query": "q", "documents": ["a"]})):
            reply = await http.post(path, json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


async def test_rerank_top_n_zero_or_above_the_count_is_every_document(
        fake_engine: FakeEngine) -> None:
    """As vLLM: `top_n` 0 (or none) and a `top_n` above the documents' count return every
    document, best first; a smaller one the best that many."""
    fake_engine.interval = 0.0
    body = {"query": "q", "documents": ["a", "a b c d", "a b"]}
    ranked: dict[int | None, list[int]] = {}
    async with serve(build_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        for top_n in (None, 0, 2, 3, 5):
            reply = await http.post("/v1/rerank", json={**body, "top_n": top_n})
            assert reply.status_code == 200, reply.text
            results = reply.json()["results"]
            scores = [r["relevance_score"] for r in results]
            assert scores == sorted(scores, reverse=True)
            ranked[top_n] = [r["index"] for r in results]
    assert sorted(ranked[None]) == [0, 1, 2]
    assert ranked[0] == ranked[3] == ranked[5] == ranked[None]
    assert ranked[2] == ranked[None][:2]


async def _until(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize(("path", "body", "count"), [
    ("/v1/embeddings", {"input": "one"}, 1),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, 3)])
async def test_cancel_by_request_id_ends_every_engine_request(
        fake_engine: FakeEngine, path: str, body: dict, count: int) -> None:
    """Pooling requests are in the gateway's table under the request's `request_id`: the
    cancel route finds them, a second request cannot take the id, and the client's answer is
    500 `cancelled` (not to be retried)."""
    fake_engine.interval = 30.0  # NOTE: never finishes by itself
    gw = Gateway(fake_engine)
    async with serve(build_app(fake_engine, gateway=gw)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        call = asyncio.create_task(http.post(path, json={**body, "request_id": "pool-1"}))
        await _until(lambda: len(fake_engine.submitted) == count, "all submitted")
        assert len(gw.generations) == count
        again = await http.post(path, json={**body, "request_id": "pool-1"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id"
        cancelled = await http.post("/v1/requests/pool-1/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        reply = await call
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "cancelled"
        assert reply.headers["x-should-retry"] == "false"
        assert (await http.post("/v1/requests/pool-1/cancel")).status_code == 404
    assert sorted(fake_engine.aborted) == sorted(m.request_id for m in fake_engine.submitted)
    assert not gw.generations


async def test_a_drain_waits_for_pooling_requests(fake_engine: FakeEngine) -> None:
    """SIGTERM's checklist (gateway/serving.py _Drainer) waits while an embeddings request is in
    flight, and stops the server once it has answered."""
    fake_engine.interval = 30.0
    gw = Gateway(fake_engine)
    server = SimpleNamespace(should_exit=False)
    drainer = _Drainer(gw, 30.0, Notifier({}))
    async with serve(build_app(fake_engine, gateway=gw)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        call = asyncio.create_task(http.post("/v1/embeddings", json={"input": [[4, 5]]}))
        await _until(lambda: fake_engine.submitted, "submitted")
        drain = asyncio.create_task(drainer.drain(server))  # type: ignore[arg-type]
        await _until(lambda: gw.draining, "draining")
        refused = await http.post("/v1/embeddings", json={"input": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
        await asyncio.sleep(0.2)
        assert not drain.done() and not server.should_exit
        # NOTE: the engine answers now (the fake's feed would only after 30 s)
        (rid,) = [m.request_id for m in fake_engine.submitted]
        fake_engine._tasks.pop(rid).cancel()
        fake_engine.streams[rid].queue.put_nowait(
            TokenDelta(request_id=rid, finish_reason="stop", pooled=[1.0, 2.0]))
        reply = await call
        await asyncio.wait_for(drain, 5)
    assert reply.status_code == 200 and reply.json()["data"][0]["embedding"] == [1.0, 2.0]
    assert server.should_exit and not drainer.timed_out and not fake_engine.aborted
