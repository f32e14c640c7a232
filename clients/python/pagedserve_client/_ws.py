"""WebSocket client for `/v1/ws` (subprotocol `pagedserve.v1`): many generations on one socket.

A reader task routes frames by generation id into per-generation queues. When the server closes
with 1001/1011/1012/1013 (going away, error, restart, try again later) the client reconnects with
backoff; generations that were running on the old socket end with APIConnectionError, since the
server aborted them when the socket closed, except resumable ones (`resumable=True`): those
are resumed on the new socket after their last delta (also after a plain network drop).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from pagedserve_client._errors import APIConnectionError, PagedServeError, stream_error
from pagedserve_client._retry import retry_delay
from pagedserve_client._types import ChatCompletionChunk, GenerationDone

SUBPROTOCOL = "pagedserve.v1"
RECONNECT_CODES = frozenset({1001, 1011, 1012, 1013})
NO_RESUME_CODES = frozenset({1000, 1008})  # a normal close, a policy refusal (bad key, origin)
_END = object()


class Generation:
    """One generation's chunks as an async iterator; `done` holds the final frame once it ends.
    Leaving `async with generation:` early cancels it on the server."""

    def __init__(self, socket: WebSocketClient, gen_id: str) -> None:
        self.id = gen_id
        self.request_id: str | None = None
        self.stream_id: str | None = None  # set when the server made it resumable
        self.last_seq = -1  # the last delta's seq: where a resume continues
        self.done: GenerationDone | None = None
        self._socket = socket
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._finished = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, ChatCompletionChunk):
            return item
        self._finished = True
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel on the server if still running (the server then sends `generation.done`)."""
        if self.done is None and not self._finished and self.id in self._socket._generations:
            await self._socket.cancel(self.id)

    async def text(self) -> str:
        """Consume the generation and return all its text."""
        return "".join([chunk.text async for chunk in self])

    def _push(self, item: Any) -> None:
        self._queue.put_nowait(item)


class WebSocketClient:
    """`async with WebSocketClient(url) as ws: gen = await ws.generate(messages=...)`."""

    def __init__(self, url: str, *, api_key: str | None = None, reconnect: bool = True,
                 max_reconnect_attempts: int = 5, open_timeout: float = 10.0) -> None:
        self.url = url
        self.session_id: str | None = None
        self.model: str | None = None
        self.draining = False
        self._api_key = api_key
        self._reconnect = reconnect
        self._max_attempts = max_reconnect_attempts
        self._open_timeout = open_timeout
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._closing = False
        self._failure: PagedServeError | None = None
        self._generations: dict[str, Generation] = {}
        self._ids = itertools.count(1)
        self.reconnects = 0

    async def __aenter__(self) -> WebSocketClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        try:
            self._ws = await connect(self.url, subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
                                     additional_headers=headers,
                                     open_timeout=self._open_timeout)
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise APIConnectionError(f"WebSocket connect failed: {exc}") from exc
        self._failure = None
        self._ready.set()
        self._reader = asyncio.create_task(self._read(self._ws))

    async def close(self) -> None:
        self._closing = True
        self._ready.clear()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_all(APIConnectionError("the WebSocket client was closed"))

    async def generate(self, *, messages: list[dict[str, Any]], model: str | None = None,
                       id: str | None = None, **params: Any) -> Generation:
        """Start a generation (chat request fields as keywords); iterate it for chunks."""
        ws = await self._open_socket()
        gen_id = id or f"g{next(self._ids)}"
        request = {k: v for k, v in {"messages": messages, "model": model, **params}.items()
                   if v is not None}
        gen = Generation(self, gen_id)
        self._generations[gen_id] = gen
        await self._send(ws, {"type": "generate", "id": gen_id, "request": request})
        return gen

    async def cancel(self, gen_id: str) -> None:
        """Ask the server to stop a generation; it then ends with status `cancelled`."""
        await self._send(await self._open_socket(), {"type": "cancel", "id": gen_id})

    async def ping(self) -> None:
        await self._send(await self._open_socket(), {"type": "ping"})

    async def _open_socket(self) -> ClientConnection:
        if self._closing:
            raise APIConnectionError("the WebSocket client is closed")
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure
        assert self._ws is not None
        return self._ws

    async def _send(self, ws: ClientConnection, frame: dict[str, Any]) -> None:
        try:
            await ws.send(msgspec.json.encode(frame).decode())
        except ConnectionClosed as exc:
            raise APIConnectionError(f"WebSocket closed: {exc}") from exc

    async def _read(self, ws: ClientConnection) -> None:
        code: int | None = None
        try:
            async for raw in ws:
                self._dispatch(msgspec.json.decode(raw))
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
        else:
            code = ws.close_code
        self._ready.clear()
        resumable = self._reconnect and not self._closing and code not in NO_RESUME_CODES
        self._fail_all(APIConnectionError(f"WebSocket closed (code {code})"), resumable)
        if self._closing:
            return
        if self._reconnect and (code in RECONNECT_CODES or (resumable and self._generations)):
            await self._reconnect_loop()
        else:
            self._failure = APIConnectionError(f"WebSocket closed (code {code})")
            self._ready.set()

    async def _reconnect_loop(self) -> None:
        for attempt in range(self._max_attempts):
            await asyncio.sleep(retry_delay(attempt))
            if self._closing:
                return
            try:
                await self.connect()
            except APIConnectionError as exc:
                self._failure = exc
                continue
            self.reconnects += 1
            await self._resume_all()
            return
        self._ready.set()  # NOTE: wakes waiters, who then raise the last failure
        self._fail_all(self._failure or APIConnectionError("WebSocket reconnect failed"))

    async def _resume_all(self) -> None:
        assert self._ws is not None
        for gen in list(self._generations.values()):
            frame = {"type": "resume", "id": gen.id, "stream_id": gen.stream_id,
                     "after_seq": gen.last_seq}
            try:
                await self._send(self._ws, frame)
            except APIConnectionError as exc:
                self._end(gen, exc)

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind, gen = frame.get("type"), self._generations.get(frame.get("id", ""))
        if kind == "session.created":
            self.session_id, self.model = frame.get("session_id"), frame.get("model")
            self.draining = False
        elif kind == "session.draining":
            self.draining = True
        elif gen is None:
            return  # NOTE: pong, or a frame for a generation this client already ended
        elif kind == "generation.started":
            gen.request_id, gen.stream_id = frame.get("request_id"), frame.get("stream_id")
        elif kind == "generation.delta":
            gen.last_seq = frame.get("seq", gen.last_seq)
            gen._push(msgspec.convert(frame["chunk"], ChatCompletionChunk))
        elif kind == "generation.done":
            gen.done = msgspec.convert(frame, GenerationDone)
            self._end(gen, _END)
        elif kind == "error":
            self._end(gen, stream_error(frame, gen.request_id))

    def _end(self, gen: Generation, item: Any) -> None:
        self._generations.pop(gen.id, None)
        gen._push(item)

    def _fail_all(self, error: PagedServeError, keep_resumable: bool = False) -> None:
        for gen in list(self._generations.values()):
            if not (keep_resumable and gen.stream_id is not None):
                self._end(gen, error)
