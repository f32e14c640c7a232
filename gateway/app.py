"""The Starlette app: OpenAI endpoints (JSON and SSE), cancel, health, version, metrics, OpenAPI.

`build_app(client, settings)` takes any EngineClient-shaped object, so tests can script one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from gateway.auth import ApiKeyMiddleware
from gateway.chunks import Accumulator, ChunkBuilder
from gateway.errors import ApiError
from gateway.generation import EngineClientLike, Generation, Piece, piece_error
from gateway.metrics import CONTENT_TYPE
from gateway.openapi import openapi_document, package_version
from gateway.protocol import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    decode_request,
)
from gateway.service import Gateway, GatewaySettings
from gateway.streaming import DisconnectAwareResponse, EventStreamResponse
from gateway.tracing import trace_headers
from gateway.ws import WebSocketEndpoint
from ipc.messages import FINISH_ERROR

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
STATIC = Path(__file__).parent / "static"  # the chat page (clients/typescript builds sdk/)


def sse_event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (header or stream)."""
    too_large = ApiError(413, f"request body is larger than {limit} bytes", "request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class Handlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def models(self, request: Request) -> Response:
        gw = self.gw
        cards = []
        if gw.model_name is not None:
            info = gw.client.info
            cards.append(ModelCard(gw.model_name, int(time.time()),
                                   max_model_len=info.max_model_len if info else None))
        return _json(ModelList(cards))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def _generate(self, request: Request, kind: type[AnyRequest]) -> Response:
        try:
            body = await read_body(request, self.gw.settings.max_body_bytes)
            parsed = decode_request(body, kind)
            job = self.gw.prepare(parsed)
            job.trace_headers = trace_headers(request.headers)
            gen = self.gw.start(job)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            # Gone before its body arrived (an overloaded gateway reads late): still counted.
            self.gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        headers = {"X-Request-Id": job.request_id}
        disconnected = self.gw.metrics.client_disconnects.inc
        if parsed.stream:
            pieces = aiter(gen)
            first: list[Piece | None] = []
            if job.sampling.structured_outputs is not None:
                # NOTE: a grammar the engine refuses is the request's fault: answer 400, not a
                # stream; the first piece (or the first tick, while it compiles) decides.
                piece = await anext(pieces, None)
                if piece is not None and piece.finish_reason == FINISH_ERROR:
                    await gen.aclose()
                    self.gw.finished(gen)
                    return piece_error(piece).response()
                first.append(piece)
            return EventStreamResponse(self._sse(gen, pieces, first), disconnected, headers)
        return DisconnectAwareResponse(lambda: self._collect(gen, headers), disconnected)

    async def _sse(self, gen: Generation, pieces: AsyncIterator[Piece | None],
                   first: list[Piece | None]) -> AsyncIterator[bytes]:
        builder = ChunkBuilder(gen, self.gw.namer())
        try:
            async for piece in _chain(first, pieces):
                if piece is None:
                    yield PING
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    yield sse_event(piece_error(piece).envelope())
                    break
                chunk = builder.chunk(piece)
                if chunk is not None:
                    yield sse_event(chunk)
            else:
                if gen.job.include_usage:
                    yield sse_event(builder.usage_chunk())
            yield DONE
        finally:
            await gen.aclose()
            self.gw.finished(gen)

    async def _collect(self, gen: Generation, headers: dict[str, str]) -> Response:
        acc = Accumulator(gen, self.gw.namer())
        try:
            async for piece in gen:
                if piece is None:
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    return piece_error(piece).response()
                acc.add(piece)
        finally:
            await gen.aclose()
            self.gw.finished(gen)
        return _json(acc.response(gen.finish_reason), headers)

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if not self.gw.cancel(request_id):
            return ApiError(404, f"no running request `{request_id}`", "request_not_found",
                            "request_id").response()
        return JSONResponse({"id": request_id, "object": "request.cancelled", "cancelled": True})

    async def health(self, request: Request) -> Response:
        if self.gw.ready:
            return JSONResponse({"status": "ok"})
        status = "draining" if self.gw.draining else "engine_unavailable"
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})

    async def livez(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def version(self, request: Request) -> Response:
        info = self.gw.client.info
        return JSONResponse({
            "version": package_version(),
            "model": info.model if info else None,
            "engine_incarnation": info.incarnation if info else None,
        })

    async def metrics(self, request: Request) -> Response:
        return Response(self.gw.metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        return _json(openapi_document())


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in the API's error shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return ApiError(exc.status_code, str(exc.detail), code).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug's 500 in the API's error shape (Starlette still re-raises it for the server's log)."""
    return ApiError(500, "internal server error", "internal_error").response()


async def _chain(first: list[Piece | None],
                 rest: AsyncIterator[Piece | None]) -> AsyncIterator[Piece | None]:
    for piece in first:
        yield piece
    async for piece in rest:
        yield piece


def _json(payload: object, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), headers=headers, media_type="application/json")


def build_app(client: EngineClientLike, settings: GatewaySettings | None = None,
              gateway: Gateway | None = None) -> Starlette:
    gw = gateway or Gateway(client, settings or GatewaySettings())
    h = Handlers(gw)
    routes = [
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/requests/{request_id}/cancel", h.cancel, methods=["POST"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/livez", h.livez, methods=["GET"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/openapi.json", h.openapi, methods=["GET"]),
        WebSocketRoute("/v1/ws", WebSocketEndpoint(gw)),
        Route("/", lambda request: FileResponse(STATIC / "index.html"), methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [
        Middleware(CORSMiddleware, allow_origins=list(gw.settings.allowed_origins),
                   allow_methods=["GET", "POST", "OPTIONS"],
                   allow_headers=["Authorization", "Content-Type", "traceparent",
                                  "tracestate"],
                   expose_headers=["X-Request-Id", "Retry-After"]),
        Middleware(ApiKeyMiddleware, api_key=gw.settings.api_key),
    ]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.gateway = gw
    return app
