"""The Python SDK (HTTP, SSE, WebSocket), the official openai package and the chat page's files
against a real server (one per module: server start-up dominates this folder's time)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pagedserve_client as ps
import pytest
from tiny_server import metric, wait_idle

pytestmark = pytest.mark.timeout(120)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
LONG = {"max_tokens": 3000, "ignore_eos": True}


def test_models_and_chat(server_url: str) -> None:
    with ps.Client(server_url) as client:
        model = client.models.list().data[0]
        assert model.id == "tiny-llama" and model.max_model_len == 4096
        reply = client.chat.completions.create(messages=MESSAGES, max_tokens=5, ignore_eos=True,
                                               temperature=0)
        assert reply.choices[0].finish_reason == ps.FinishReason.LENGTH
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        with client.chat.completions.create(messages=MESSAGES, max_tokens=5, ignore_eos=True,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}) as stream:
            chunks = list(stream)
        assert stream.request_id and chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.text for c in chunks) == reply.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_closing_a_stream_cancels_it(server_url: str) -> None:
    with ps.Client(server_url) as client:
        with client.completions.create(prompt="Once", stream=True, **LONG) as stream:
            assert next(stream).text is not None
            assert metric(server_url, "pagedserve_requests_running") == 1
    assert wait_idle(server_url) == 0


def test_errors_are_typed(server_url: str) -> None:
    with ps.Client(server_url, max_retries=0) as client:
        with pytest.raises(ps.BadRequestError) as bad:
            client.chat.completions.create(messages=MESSAGES, max_tokens=0)
        assert bad.value.code == "invalid_value" and bad.value.param == "max_tokens"
        with pytest.raises(ps.NotFoundError) as missing:
            client.chat.completions.create(messages=MESSAGES, model="no-such-model")
        assert missing.value.code == "model_not_found"
    with pytest.raises(ps.APIConnectionError):
        ps.Client("http://127.0.0.1:9", max_retries=0).models.list()


async def test_async_stream_and_cancel(server_url: str) -> None:
    async with ps.AsyncClient(server_url) as client:
        stream = await client.chat.completions.create(messages=MESSAGES, stream=True, **LONG)
        async with stream:
            pieces = [await stream.__anext__() for _ in range(3)]
        assert len(pieces) == 3
        assert await asyncio.to_thread(wait_idle, server_url) == 0
        done = await client.completions.create(prompt="Hi", max_tokens=3, ignore_eos=True)
        assert done.usage is not None and done.usage.completion_tokens == 3


async def test_websocket_many_generations_and_cancel(server_url: str) -> None:
    async with ps.AsyncClient(server_url) as client, client.websocket() as ws:
        short = [await ws.generate(messages=MESSAGES, max_tokens=8, ignore_eos=True)
                 for _ in range(3)]
        long = await ws.generate(messages=MESSAGES, **LONG)
        texts = await asyncio.gather(*(g.text() for g in short))
        assert all(texts) and all(g.done and g.done.finish_reason == "length" for g in short)
        assert all(g.done and g.done.usage and g.done.usage.completion_tokens == 8 for g in short)
        await long.__anext__()
        await ws.cancel(long.id)
        await long.text()
        assert long.done is not None and long.done.status == ps.GenerationStatus.CANCELLED
        bad = await ws.generate(messages=MESSAGES, max_tokens=0)
        with pytest.raises(ps.StreamError) as info:
            await bad.text()
        assert info.value.code == "invalid_value"
        async with await ws.generate(messages=MESSAGES, **LONG) as gen:
            await gen.__anext__()
    assert await asyncio.to_thread(wait_idle, server_url) == 0


def test_openai_python_conformance(server_url: str) -> None:
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert info.value.code == "invalid_value"


def test_chat_page_and_static_files(server_url: str) -> None:
    page = httpx.get(f"{server_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/chat.js">' in page.text
    for path in ("chat.js", "chat.css", "sdk/index.js", "sdk/ws.js"):
        response = httpx.get(f"{server_url}/static/{path}")
        assert response.status_code == 200, path
    assert "javascript" in httpx.get(f"{server_url}/static/chat.js").headers["content-type"]
    assert httpx.get(f"{server_url}/static/nope.js").status_code == 404


def test_models_tokenize_and_n_choices(server_url: str) -> None:
    from pagedserve_client import Client, NotFoundError

    with Client(server_url) as client:
        model = client.models.list().data[0].id
        assert client.models.retrieve(model).id == model
        with pytest.raises(NotFoundError):
            client.models.retrieve("no-such-model")
        tokens = client.tokenize(prompt="Hello world")
        assert tokens.count == len(tokens.tokens) and client.detokenize(tokens.tokens) == (
            "Hello world")
        reply = client.completions.create(prompt=["a", "b"], n=2, max_tokens=2,
                                          echo=True, logprobs=0, temperature=0)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert reply.choices[0].logprobs.token_logprobs[0] is None
        assert reply.choices[2].text.startswith("b")
