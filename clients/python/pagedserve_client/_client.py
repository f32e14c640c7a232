"""`Client` (sync) and `AsyncClient` over httpx: chat completions, completions, responses,
embeddings, rerank and score, models, cancel, tokenize/detokenize.

Both retry 408/409/429/5xx and connection errors with backoff (honouring Retry-After) before any
byte of a response reaches the caller; a stream already handed out is never retried, but a
resumable one (`resumable=True`) that breaks is resumed after its last event (_streaming.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Literal, TypeVar, overload
from urllib.parse import quote

import httpx
import msgspec

from pagedserve_client import _embeddings
from pagedserve_client._base import ClientSettings, body, connection_error
from pagedserve_client._embeddings import (
    AsyncEmbeddings,
    Document,
    Embeddings,
    RerankResponse,
    ScoreResponse,
)
from pagedserve_client._errors import status_error
from pagedserve_client._responses import AsyncResponses, Responses
from pagedserve_client._retry import retry_delay, should_retry
from pagedserve_client._streaming import AsyncStream, Resumer, Stream
from pagedserve_client._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Model,
    ModelList,
    ModelLoaded,
    ModelState,
    ModelStates,
    Tokenized,
)
from pagedserve_client._ws import WebSocketClient

T = TypeVar("T")
Messages = list[dict[str, Any]]
# a text, texts, token ids or token-id lists (several prompts: choice j of prompt p is p*n+j)
Prompt = str | list[str] | list[int] | list[list[int]]


class Client:
    """Blocking client. `with Client(base_url) as client: client.chat.completions.create(...)`."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = None, max_retries: int = 2,
                 http_client: httpx.Client | None = None) -> None:
        self.settings = ClientSettings(base_url, api_key, timeout, max_retries)
        self._http = http_client or httpx.Client(timeout=self.settings.timeout)
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.responses = Responses(self)
        self.embeddings = Embeddings(self)
        self.models = Models(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def cancel(self, request_id: str) -> bool:
        """Ask the server to abort a running request (by the X-Request-Id it returned)."""
        self.request("POST", f"/v1/requests/{request_id}/cancel", None).close()
        return True

    def tokenize(self, **payload: Any) -> Tokenized:
        """POST /tokenize (vLLM's): `prompt=` or `messages=` (as chat renders them)."""
        response = self.request("POST", "/tokenize", payload)
        return msgspec.json.decode(response.content, type=Tokenized)

    def detokenize(self, tokens: list[int]) -> str:
        """POST /detokenize: the text of token ids."""
        return self.request("POST", "/detokenize", {"tokens": tokens}).json()["prompt"]

    def rerank(self, *, query: str, documents: list[Document], model: str | None = None,
               top_n: int | None = None, **params: Any) -> RerankResponse:
        """POST /v1/rerank: documents by relevance to the query, best first; `params`:
        return_documents, priority."""
        return _embeddings.rerank(self, query, documents, model, top_n, params)

    def score(self, *, text_1: str | list[str], text_2: str | list[str],
              model: str | None = None) -> ScoreResponse:
        """POST /v1/score (vLLM's): text_1 against each text_2 (1 -> N), or pairwise (N <-> N)."""
        return _embeddings.score(self, text_1, text_2, model)

    def request(self, method: str, path: str, payload: dict[str, Any] | None,
                stream: bool = False, headers: dict[str, str] | None = None) -> httpx.Response:
        """Send with retries; returns a response with a 2xx status or raises a typed error."""
        s = self.settings
        content = body(payload) if payload is not None else None
        headers = {**s.headers, **({"Content-Type": "application/json"} if content else {}),
                   **(headers or {})}
        request = self._http.build_request(method, s.base_url + path, content=content,
                                           headers=headers)
        for attempt in range(s.max_retries + 1):
            last = attempt == s.max_retries
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if last:
                    raise connection_error(exc) from exc
                time.sleep(retry_delay(attempt))
                continue
            if response.status_code < 400:
                return response
            content_out = response.read()
            response.close()
            if last or not should_retry(response.status_code):
                raise status_error(response.status_code, content_out,
                                   response.headers.get("x-request-id"))
            time.sleep(retry_delay(attempt, response.headers))
        raise AssertionError("unreachable")

    def _create(self, path: str, payload: dict[str, Any], cls: type[T], chunk: type[Any]
                ) -> T | Stream[Any]:
        response = self.request("POST", path, payload, stream=bool(payload.get("stream")))
        if payload.get("stream"):
            return Stream(response, chunk, self._resumer(response))
        return msgspec.json.decode(response.content, type=cls)

    def _resumer(self, response: httpx.Response) -> Resumer[httpx.Response] | None:
        stream_id = response.headers.get("x-stream-id")
        if stream_id is None:
            return None
        path = f"/v1/streams/{stream_id}"

        def reopen(last_event_id: str | None) -> httpx.Response:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else None
            return self.request("GET", path, None, stream=True, headers=headers)

        return Resumer(stream_id, reopen, lambda: self.request("DELETE", path, None).close())


class AsyncClient:
    """Asyncio client: `async with AsyncClient(base_url) as client: ...`; also WebSockets."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = None, max_retries: int = 2,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self.settings = ClientSettings(base_url, api_key, timeout, max_retries)
        self._http = http_client or httpx.AsyncClient(timeout=self.settings.timeout)
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.responses = AsyncResponses(self)
        self.embeddings = AsyncEmbeddings(self)
        self.models = AsyncModels(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    def websocket(self, **options: Any) -> WebSocketClient:
        """A WebSocket client for this server: `async with client.websocket() as ws: ...`."""
        s = self.settings
        return WebSocketClient(s.ws_url, api_key=s.api_key, **options)

    async def cancel(self, request_id: str) -> bool:
        await (await self.request("POST", f"/v1/requests/{request_id}/cancel", None)).aclose()
        return True

    async def tokenize(self, **payload: Any) -> Tokenized:
        """POST /tokenize (vLLM's): `prompt=` or `messages=` (as chat renders them)."""
        response = await self.request("POST", "/tokenize", payload)
        return msgspec.json.decode(response.content, type=Tokenized)

    async def detokenize(self, tokens: list[int]) -> str:
        """POST /detokenize: the text of token ids."""
        return (await self.request("POST", "/detokenize", {"tokens": tokens})).json()["prompt"]

    async def rerank(self, *, query: str, documents: list[Document], model: str | None = None,
                     top_n: int | None = None, **params: Any) -> RerankResponse:
        return await _embeddings.async_rerank(self, query, documents, model, top_n, params)

    async def score(self, *, text_1: str | list[str], text_2: str | list[str],
                    model: str | None = None) -> ScoreResponse:
        return await _embeddings.async_score(self, text_1, text_2, model)

    async def request(self, method: str, path: str, payload: dict[str, Any] | None,
                      stream: bool = False, headers: dict[str, str] | None = None
                      ) -> httpx.Response:
        s = self.settings
        content = body(payload) if payload is not None else None
        headers = {**s.headers, **({"Content-Type": "application/json"} if content else {}),
                   **(headers or {})}
        request = self._http.build_request(method, s.base_url + path, content=content,
                                           headers=headers)
        for attempt in range(s.max_retries + 1):
            last = attempt == s.max_retries
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if last:
                    raise connection_error(exc) from exc
                await asyncio.sleep(retry_delay(attempt))
                continue
            if response.status_code < 400:
                return response
            content_out = await response.aread()
            await response.aclose()
            if last or not should_retry(response.status_code):
                raise status_error(response.status_code, content_out,
                                   response.headers.get("x-request-id"))
            await asyncio.sleep(retry_delay(attempt, response.headers))
        raise AssertionError("unreachable")

    async def _create(self, path: str, payload: dict[str, Any], cls: type[T], chunk: type[Any]
                      ) -> T | AsyncStream[Any]:
        response = await self.request("POST", path, payload, stream=bool(payload.get("stream")))
        if payload.get("stream"):
            return AsyncStream(response, chunk, self._resumer(response))
        return msgspec.json.decode(response.content, type=cls)

    def _resumer(self, response: httpx.Response
                 ) -> Resumer[Awaitable[httpx.Response]] | None:
        stream_id = response.headers.get("x-stream-id")
        if stream_id is None:
            return None
        path = f"/v1/streams/{stream_id}"

        async def reopen(last_event_id: str | None) -> httpx.Response:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else None
            return await self.request("GET", path, None, stream=True, headers=headers)

        async def cancel() -> None:
            await (await self.request("DELETE", path, None)).aclose()

        return Resumer(stream_id, reopen, cancel)


# ---- resources ----------------------------------------------------------------------------


class ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, messages: Messages, model: str | None = ...,
               stream: Literal[False] = ..., **params: Any) -> ChatCompletion: ...
    @overload
    def create(self, *, messages: Messages, model: str | None = ...,
               stream: Literal[True], **params: Any) -> Stream[ChatCompletionChunk]: ...
    def create(self, *, messages: Messages, model: str | None = None, stream: bool = False,
               **params: Any) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """POST /v1/chat/completions; `params` are OpenAI's (and vLLM's) request fields."""
        payload = {"messages": messages, "model": model, "stream": stream, **params}
        return self._client._create("/v1/chat/completions", payload, ChatCompletion,
                                    ChatCompletionChunk)


class Chat:
    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, prompt: Prompt, model: str | None = ...,
               stream: Literal[False] = ..., **params: Any) -> Completion: ...
    @overload
    def create(self, *, prompt: Prompt, model: str | None = ...,
               stream: Literal[True], **params: Any) -> Stream[Completion]: ...
    def create(self, *, prompt: Prompt, model: str | None = None, stream: bool = False,
               **params: Any) -> Completion | Stream[Completion]:
        """POST /v1/completions."""
        payload = {"prompt": prompt, "model": model, "stream": stream, **params}
        return self._client._create("/v1/completions", payload, Completion, Completion)


def _load_body(model: str, path: str | None, data_parallel_size: int | None,
               options: dict[str, Any]) -> dict[str, Any]:
    extra = {"path": path, "data_parallel_size": data_parallel_size}
    return {"model": model, **{k: v for k, v in extra.items() if v is not None}, **options}


def _unload_body(model: str, timeout: float | None) -> dict[str, Any]:
    return {"model": model} if timeout is None else {"model": model, "timeout": timeout}


class Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def states(self) -> list[ModelState]:
        """GET /models: every model the server knows, loaded or not, with its engines."""
        response = self._client.request("GET", "/models", None)
        return msgspec.json.decode(response.content, type=ModelStates).data

    def load(self, model: str, *, path: str | None = None,
             data_parallel_size: int | None = None, **options: Any) -> ModelLoaded:
        """POST /models/load: serve `model` (a known one again, or a new one from `path` with
        engine options such as max_model_len); returns once its engines are ready."""
        payload = _load_body(model, path, data_parallel_size, options)
        response = self._client.request("POST", "/models/load", payload)
        return msgspec.json.decode(response.content, type=ModelLoaded)

    def unload(self, model: str, *, timeout: float | None = None) -> ModelLoaded:
        """POST /models/unload: stop serving `model`; its requests get `timeout` seconds to
        finish (default: aborted now), then its engine processes exit."""
        response = self._client.request("POST", "/models/unload", _unload_body(model, timeout))
        return msgspec.json.decode(response.content, type=ModelLoaded)

    def list(self) -> ModelList:
        response = self._client.request("GET", "/v1/models", None)
        return msgspec.json.decode(response.content, type=ModelList)

    def retrieve(self, model_id: str) -> Model:
        """GET /v1/models/{id} (NotFoundError for another id)."""
        response = self._client.request("GET", f"/v1/models/{quote(model_id, safe='/')}", None)
        return msgspec.json.decode(response.content, type=Model)


class AsyncChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, messages: Messages, model: str | None = ...,
                     stream: Literal[False] = ..., **params: Any) -> ChatCompletion: ...
    @overload
    async def create(self, *, messages: Messages, model: str | None = ...,
                     stream: Literal[True], **params: Any) -> AsyncStream[ChatCompletionChunk]: ...
    async def create(self, *, messages: Messages, model: str | None = None, stream: bool = False,
                     **params: Any) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        payload = {"messages": messages, "model": model, "stream": stream, **params}
        return await self._client._create("/v1/chat/completions", payload, ChatCompletion,
                                          ChatCompletionChunk)


class AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)


class AsyncCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, prompt: Prompt, model: str | None = ...,
                     stream: Literal[False] = ..., **params: Any) -> Completion: ...
    @overload
    async def create(self, *, prompt: Prompt, model: str | None = ...,
                     stream: Literal[True], **params: Any) -> AsyncStream[Completion]: ...
    async def create(self, *, prompt: Prompt, model: str | None = None,
                     stream: bool = False, **params: Any) -> Completion | AsyncStream[Completion]:
        payload = {"prompt": prompt, "model": model, "stream": stream, **params}
        return await self._client._create("/v1/completions", payload, Completion, Completion)


class AsyncModels:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def states(self) -> list[ModelState]:
        """GET /models (as Models.states)."""
        response = await self._client.request("GET", "/models", None)
        return msgspec.json.decode(response.content, type=ModelStates).data

    async def load(self, model: str, *, path: str | None = None,
                   data_parallel_size: int | None = None, **options: Any) -> ModelLoaded:
        """POST /models/load (as Models.load)."""
        payload = _load_body(model, path, data_parallel_size, options)
        response = await self._client.request("POST", "/models/load", payload)
        return msgspec.json.decode(response.content, type=ModelLoaded)

    async def unload(self, model: str, *, timeout: float | None = None) -> ModelLoaded:
        """POST /models/unload (as Models.unload)."""
        response = await self._client.request("POST", "/models/unload",
                                              _unload_body(model, timeout))
        return msgspec.json.decode(response.content, type=ModelLoaded)

    async def list(self) -> ModelList:
        response = await self._client.request("GET", "/v1/models", None)
        return msgspec.json.decode(response.content, type=ModelList)

    async def retrieve(self, model_id: str) -> Model:
        """GET /v1/models/{id} (NotFoundError for another id)."""
        path = f"/v1/models/{quote(model_id, safe='/')}"
        response = await self._client.request("GET", path, None)
        return msgspec.json.decode(response.content, type=Model)
