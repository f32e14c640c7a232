"""WebSocketClient reconnects on 1001/1011/1012/1013 and not on other codes (scripted server)."""

from __future__ import annotations

import asyncio
import json

import pagedserve_client as ps
import pytest
from websockets.asyncio.server import ServerConnection, serve


async def _scripted(close_codes: list[int]):
    """A pagedserve.v1-speaking server whose n-th connection closes with close_codes[n]
    after its first generate frame (past the list: it answers the generation)."""
    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        n, connections = connections, connections + 1
        await ws.send(json.dumps({"type": "session.created", "session_id": f"s{n}"}))
        async for raw in ws:
            frame = json.loads(raw)
            if frame["type"] != "generate":
                continue
            if n < len(close_codes):
                await ws.close(close_codes[n], "scripted")
                return
            chunk = {"id": "r", "choices": [{"index": 0, "delta": {"content": "ok"}}]}
            await ws.send(json.dumps({"type": "generation.delta", "id": frame["id"], "seq": 0,
                                      "chunk": chunk}))
            await ws.send(json.dumps({"type": "generation.done", "id": frame["id"],
                                      "status": "completed", "finish_reason": "stop"}))

    server = await serve(handler, "127.0.0.1", 0, subprotocols=["pagedserve.v1"])
    port = server.sockets[0].getsockname()[1]
    return server, f"ws://127.0.0.1:{port}/v1/ws"


@pytest.mark.parametrize("code", [1001, 1011, 1012, 1013])
async def test_reconnects_on_transient_close(code: int) -> None:
    server, url = await _scripted([code])
    async with server, ps.WebSocketClient(url) as ws:
        first = await ws.generate(messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ps.APIConnectionError):
            await asyncio.wait_for(first.text(), 5)
        second = await asyncio.wait_for(ws.generate(messages=[]), 5)
        assert await asyncio.wait_for(second.text(), 5) == "ok"
        assert second.done is not None and second.done.status == ps.GenerationStatus.COMPLETED
        assert ws.reconnects == 1 and ws.session_id == "s1"


async def test_no_reconnect_on_policy_close() -> None:
    server, url = await _scripted([1008])
    async with server, ps.WebSocketClient(url) as ws:
        first = await ws.generate(messages=[])
        with pytest.raises(ps.APIConnectionError):
            await asyncio.wait_for(first.text(), 5)
        with pytest.raises(ps.APIConnectionError, match="1008"):
            await asyncio.wait_for(ws.generate(messages=[]), 5)
        assert ws.reconnects == 0
