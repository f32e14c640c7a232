"""API keys: the Python SDK sends them over HTTP and WebSocket; a wrong one is a typed error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pagedserve_client as ps
import pytest
from tiny_server import running_server

pytestmark = pytest.mark.timeout(120)
KEY = "sekret-key"


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    with running_server("--api-key", KEY) as url:
        yield url


def test_http_key(keyed_url: str) -> None:
    with ps.Client(keyed_url, api_key=KEY) as client:
        assert client.models.list().data[0].id == "tiny-llama"
    with ps.Client(keyed_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(ps.AuthenticationError) as info:
            client.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


async def test_websocket_key(keyed_url: str) -> None:
    async with ps.AsyncClient(keyed_url, api_key=KEY) as client, client.websocket() as ws:
        gen = await ws.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert await asyncio.wait_for(gen.text(), 30)
    async with ps.AsyncClient(keyed_url, api_key="wrong") as client:
        with pytest.raises(ps.APIConnectionError):
            async with client.websocket():
                pass
