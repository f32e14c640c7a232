"""The Starlette app: OpenAI endpoints (JSON and SSE), Anthropic Messages (gateway/api/), cancel,
health, version, metrics, OpenAPI.

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

from gateway.api.anthropic_errors import anthropic_error_response, is_messages_path
from gateway.api.anthropic_messages import messages_routes
from gateway.api.embeddings import EmbeddingsApi
from gateway.api.lora import LoraRoutes, adapter_cards
from gateway.api.model_management import model_cards, model_routes
from gateway.api.openai_responses import ResponsesRoutes
from gateway.api.rerank import RerankApi
from gateway.auth import ApiKeyMiddleware
from gateway.body import read_body
from gateway.chunks import Accumulator, ChunkBuilder, response_of, usage_chunk
from gateway.errors import ApiError
from gateway.generation import EngineClientLike, Generation, Piece, merged, piece_error
from gateway.metrics import CONTENT_TYPE
from gateway.openapi import openapi_document, package_version
from gateway.requests import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from gateway.resumable_sse import StreamRoutes, resumable_sse, wants_resumable
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.stats_stream import StatsFeed
from gateway.streaming import (
    PING,
    DisconnectAwareResponse,
    EventStreamResponse,
    json_response,
    prepend,
)
from gateway.tracing import trace_headers
from gateway.validate import check_token_ids, decode_body, decode_request
from gateway.ws import WebSocketEndpoint
from ipc.messages import FINISH_ERROR

DONE = b"data: [DONE]\n\n"
STATIC = Path(__file__).parent / "static"  # chat page, /dashboard (clients/typescript builds sdk/)


def sse_event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class Handlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        m = gateway.metrics
        self.stats_feed = StatsFeed(lambda: gateway.client.engine_stats, m.ttft.ours, m.itl.ours,
                                    lambda: len(gateway.generations))

    def _cards(self) -> list[ModelCard]:
        if self.gw.models is not None:
            return model_cards(self.gw.models)
        gw, info = self.gw, self.gw.client.info
        if gw.model_name is None:
            return []
        max_len = info.max_model_len if info else None
        return [ModelCard(gw.model_name, int(time.time()), max_model_len=max_len),
                *adapter_cards(gw.loras, gw.model_name, max_len)]

    async def models(self, request: Request) -> Response:
        return json_response(ModelList(self._cards()))

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        for card in self._cards():
            if card.id == model_id:
                return json_response(card)
        return ApiError(404, f"the model `{model_id}` does not exist", "model_not_found",
                        "model").response()

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids a prompt or conversation becomes here."""
        gw = self.gw
        try:
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
            chat = b'"messages"' in body  # NOTE: the two shapes share no tag field
            parsed = decode_body(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
            gw = gw.for_model(parsed.model)  # NOTE: several models: that model's tokenizer
            gw.require_ready()
            gw.check_model(parsed.model)
            if isinstance(parsed, TokenizeChatRequest):
                ids = await gw.chat_prompt_ids(parsed, gw.client.info.max_model_len)
            else:
                ids = await gw.encode_prompt(parsed.prompt, parsed.add_special_tokens)
        except ApiError as exc:
            return exc.response()
        strs = [gw.tokenizer().token_text(t) for t in ids] if parsed.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), gw.client.info.max_model_len,  # type: ignore[union-attr]
                                      ids, strs))

    async def detokenize(self, request: Request) -> Response:
        gw = self.gw
        try:
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
            parsed = decode_body(body, DetokenizeRequest)
            gw = gw.for_model(parsed.model)  # NOTE: several models: that model's tokenizer
            gw.require_ready()
            gw.check_model(parsed.model)
            tok = gw.tokenizer()
            check_token_ids(parsed.tokens, tok.vocab_size, "tokens")
        except ApiError as exc:
            return exc.response()
        text = tok.decode(parsed.tokens, skip_special_tokens=False)
        return json_response(DetokenizeResponse(text))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def _generate(self, request: Request, kind: type[AnyRequest]) -> Response:
        gens: list[Generation] = []
        try:
            settings = self.gw.settings
            body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            parsed = decode_request(body, kind)
            wants_resumable(parsed.resumable, False, parsed.stream)  # 400 without stream
            jobs = await self.gw.prepare_all(parsed)
            for job in jobs:
                job.trace_headers = trace_headers(request.headers)
                gens.append(self.gw.start(job))
        except ApiError as exc:
            await self._close(gens)
            return exc.response()
        except ClientDisconnect:
            # Gone before its body arrived (an overloaded gateway reads late): still counted.
            self.gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        job = jobs[0]
        headers = {"X-Request-Id": job.response_id or job.request_id}
        disconnected = self.gw.metrics.client_disconnects.inc
        if parsed.stream:
            pieces = merged(gens)
            first: list[tuple[int, Piece | None]] = []
            if job.sampling.structured_outputs is not None:
                # NOTE: a grammar the engine refuses is the request's fault: answer 400, not a
                # stream; the first piece (or the first tick, while it compiles) decides.
                item = await anext(pieces, None)
                if item is not None and item[1] is not None and \
                        item[1].finish_reason == FINISH_ERROR:
                    await pieces.aclose()
                    await self._close(gens)
                    return piece_error(item[1]).response()
                first += [] if item is None else [item]
            events = self._sse(gens, pieces, first)
            if wants_resumable(parsed.resumable, settings.resumable_streams, True):
                return resumable_sse(self.gw.streams, events, request.headers,
                                     lambda: self.gw.cancel(headers["X-Request-Id"]),
                                     disconnected, headers, settings.sse_keepalive_interval)
            return EventStreamResponse(events, disconnected, headers)
        return DisconnectAwareResponse(lambda: self._collect(gens, headers), disconnected)

    async def _close(self, gens: list[Generation]) -> None:
        for gen in gens:
            await gen.aclose()
            self.gw.finished(gen)

    async def _sse(self, gens: list[Generation],
                   pieces: AsyncIterator[tuple[int, Piece | None]],
                   first: list[tuple[int, Piece | None]]) -> AsyncIterator[bytes]:
        namer = self.gw.namer(gens[0].job.model)
        builders = [ChunkBuilder(g, namer, timeline=len(gens) == 1) for g in gens]
        try:
            async for k, piece in prepend(first, pieces):
                if piece is None:
                    yield PING
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    yield sse_event(piece_error(piece).envelope())
                    break
                chunk = builders[k].chunk(piece)
                if chunk is not None:
                    yield sse_event(chunk)
            else:
                if gens[0].job.include_usage:
                    yield sse_event(usage_chunk(gens, builders))
            yield DONE
        finally:
            await self._close(gens)

    async def _collect(self, gens: list[Generation], headers: dict[str, str]) -> Response:
        namer = self.gw.namer(gens[0].job.model)
        accs = [Accumulator(g, namer) for g in gens]
        try:
            async for k, piece in merged(gens):
                if piece is None:
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    return piece_error(piece).response()
                accs[k].add(piece)
        finally:
            await self._close(gens)
        return json_response(response_of(accs), headers)

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

    async def stats_stream(self, request: Request) -> Response:
        """The live view's feed: the kept history, then a snapshot a second (never ends)."""
        return EventStreamResponse(self.stats_feed.events(), lambda: None)

    async def openapi(self, request: Request) -> Response:
        return json_response(openapi_document())


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in the API's error shape."""
    assert isinstance(exc, HTTPException)
    if is_messages_path(request.url.path):
        return anthropic_error_response(ApiError(exc.status_code, str(exc.detail), "http_error"))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return ApiError(exc.status_code, str(exc.detail), code).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug's 500 in the API's error shape (Starlette still re-raises it for the server's log)."""
    if is_messages_path(request.url.path):
        return anthropic_error_response(ApiError(500, "internal server error", "internal_error"))
    return ApiError(500, "internal server error", "internal_error").response()


def build_app(client: EngineClientLike, settings: GatewaySettings | None = None,
              gateway: Gateway | None = None) -> Starlette:
    gw = gateway or Gateway(client, settings or GatewaySettings())
    h = Handlers(gw)

    responses = ResponsesRoutes(gw)
    streams = StreamRoutes(gw.streams, gw.settings.sse_keepalive_interval,
                           gw.metrics.client_disconnects.inc)
    routes = [
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", h.model, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        *messages_routes(gw),
        *model_routes(gw),
        Route("/v1/embeddings", EmbeddingsApi(gw).create, methods=["POST"]),
        *RerankApi(gw).routes(),  # /v1/rerank, /rerank, /v2/rerank, /score, /v1/score
        *LoraRoutes(gw).routes(),
        Route("/v1/requests/{request_id}/cancel", h.cancel, methods=["POST"]),
        Route("/v1/streams/{stream_id}", streams.resume, methods=["GET"]),
        Route("/v1/streams/{stream_id}", streams.cancel, methods=["DELETE"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/livez", h.livez, methods=["GET"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/v1/stats/stream", h.stats_stream, methods=["GET"]),
        Route("/openapi.json", h.openapi, methods=["GET"]),
        WebSocketRoute("/v1/ws", WebSocketEndpoint(gw)),
        Route("/", lambda request: FileResponse(STATIC / "index.html"), methods=["GET"]),
        Route("/dashboard", lambda request: FileResponse(STATIC / "dashboard.html"),
              methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [
        Middleware(CORSMiddleware, allow_origins=list(gw.settings.allowed_origins),
                   allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                   allow_headers=["Authorization", "Content-Type", "traceparent",
                                  "tracestate", "x-api-key", "anthropic-version",
                                  "anthropic-beta", "anthropic-dangerous-direct-browser-access",
                                  "Last-Event-ID"],
                   expose_headers=["X-Request-Id", "Retry-After", "request-id", "X-Stream-Id"]),
        Middleware(ApiKeyMiddleware, api_key=gw.settings.api_key),
    ]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.gateway = gw
    return app
