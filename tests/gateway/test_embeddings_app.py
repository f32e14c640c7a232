"""/v1/embeddings, rerank and score against the scripted engine: what reaches the engine, a
client that leaves aborts every engine request, an engine failure is a 500 in OpenAI's shape."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from ipc.pooling import PoolingInfo


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
