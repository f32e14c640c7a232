"""SSE responses as iterators of typed chunks; closing one drops the connection, which the
server turns into an abort of the request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Generic, TypeVar

import httpx
import msgspec

from pagedserve_client._errors import APIConnectionError, stream_error
from pagedserve_client._sse import ServerSentEvent, SSEDecoder

T = TypeVar("T")


def _decode(event: ServerSentEvent, cls: type[T], request_id: str | None) -> T:
    try:
        payload: Any = msgspec.json.decode(event.data)
    except msgspec.DecodeError as exc:
        raise APIConnectionError(f"invalid JSON in stream: {exc}", request_id=request_id) from None
    if event.event == "error" or (isinstance(payload, dict) and "error" in payload):
        raise stream_error(payload, request_id)
    return msgspec.convert(payload, cls)


class Stream(Generic[T]):
    """Chunks of one streamed request. Use it in a `with` block (or call `close()`) so that
    leaving early cancels the generation on the server."""

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self._cls = cls
        self._iter = self._chunks()

    def __iter__(self) -> Iterator[T]:
        return self._iter

    def __next__(self) -> T:
        return next(self._iter)

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._iter.close()
        self.response.close()

    def _chunks(self) -> Iterator[T]:
        decoder = SSEDecoder()
        try:
            for data in self.response.iter_bytes():
                for event in decoder.feed(data):
                    if event.data == "[DONE]":
                        return
                    yield _decode(event, self._cls, self.request_id)
        except httpx.TransportError as exc:
            raise APIConnectionError(f"stream broke: {exc}", request_id=self.request_id) from exc
        finally:
            self.response.close()


class AsyncStream(Generic[T]):
    """The async twin of `Stream`: `async with` it, or `await stream.aclose()`."""

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self._cls = cls
        self._iter = self._chunks()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iter

    async def __anext__(self) -> T:
        return await self._iter.__anext__()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._iter.aclose()
        await self.response.aclose()

    async def _chunks(self) -> AsyncIterator[T]:
        decoder = SSEDecoder()
        try:
            async for data in self.response.aiter_bytes():
                for event in decoder.feed(data):
                    if event.data == "[DONE]":
                        return
                    yield _decode(event, self._cls, self.request_id)
        except httpx.TransportError as exc:
            raise APIConnectionError(f"stream broke: {exc}", request_id=self.request_id) from exc
        finally:
            await self.response.aclose()
