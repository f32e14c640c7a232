"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages): each request becomes
a chat request (gateway/api/anthropic_translate.py) that runs as chat runs (`Gateway.prepare`,
`Gateway.start`); replies and stream events are written from `ChoiceEvents`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.anthropic_blocks import Blocks
from gateway.api.anthropic_errors import anthropic_error_response, anthropic_status
from gateway.api.anthropic_translate import decode_messages, to_chat
from gateway.api.anthropic_types import (
    CountTokensRequest,
    MessageDelta,
    MessageReply,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopDelta,
    StreamEvent,
    ThinkingEnabled,
    TokenCount,
)
from gateway.body import read_body
from gateway.choice_events import ChoiceEvents
from gateway.errors import ApiError
from gateway.generation import Generation, Piece, ended_error, piece_error
from gateway.resumable_sse import resumable_sse, wants_resumable
from gateway.service import Gateway
from gateway.streaming import DisconnectAwareResponse, EventStreamResponse, json_response, prepend
from gateway.structured import structured_for
from gateway.tracing import trace_headers
from ipc.messages import FINISH_ABORT, FINISH_ERROR


def messages_routes(gw: Gateway) -> list[Route]:
    api = MessagesApi(gw)
    return [Route("/v1/messages", api.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])]


def sse(event: StreamEvent) -> bytes:
    """An event as Anthropic sends it: its type as the SSE `event:` name, and the JSON."""
    name = event.__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def sse_error(exc: ApiError) -> bytes:
    return b"event: error\ndata: " + msgspec.json.encode(anthropic_status(exc)[1]) + b"\n\n"


class MessagesApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, rendered as /v1/messages renders it (system, messages, tools)."""
        gw = self.gw
        try:
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
            chat = to_chat(decode_messages(body, CountTokensRequest))
            gw = gw.for_model(chat.model)  # NOTE: several models: that model's tokenizer
            gw.require_ready()
            gw.check_model(chat.model)
            structured_for(chat, gw.call_syntax())  # NOTE: refuses what the request would
            ids = await gw.chat_prompt_ids(chat, gw.client.info.max_model_len)  # type: ignore[union-attr]
        except ApiError as exc:
            return anthropic_error_response(exc)
        except ClientDisconnect:
            self.gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        return json_response(TokenCount(len(ids)))

    async def create(self, request: Request) -> Response:
        gw = self.gw
        try:
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
            parsed: MessagesRequest = decode_messages(body, MessagesRequest)
            resumable = wants_resumable(parsed.resumable, gw.settings.resumable_streams,
                                        parsed.stream)
            job = await gw.prepare(to_chat(parsed))
            if isinstance(parsed.thinking, ThinkingEnabled) and job.reasoning_parser is None:
                raise ApiError(400, "thinking needs a server that splits reasoning from the "
                               "answer (start it with --reasoning-parser)",
                               "unsupported_parameter", "thinking")
            job.trace_headers = trace_headers(request.headers)
            gen = gw.start(job)
        except ApiError as exc:
            return anthropic_error_response(exc)
        except ClientDisconnect:
            self.gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        headers = {"request-id": job.request_id, "X-Request-Id": job.request_id}
        disconnected = self.gw.metrics.client_disconnects.inc
        if not parsed.stream:
            return DisconnectAwareResponse(lambda: self._reply(gen, headers), disconnected)
        pieces = aiter(gen)
        first: list[Piece | None] = []
        if job.sampling.structured_outputs is not None:
            # NOTE: a grammar the engine refuses (a tool schema) is the request's fault: a
            # 400, not a stream; the first piece (or tick, while it compiles) decides
            piece = await anext(pieces, None)
            if piece is not None and piece.finish_reason == FINISH_ERROR:
                await self._close(gen)
                return anthropic_error_response(piece_error(piece))
            first.append(piece)
        events = self._events(gen, first, pieces)
        if resumable:
            return resumable_sse(gw.streams, events, request.headers,
                                 lambda: gw.cancel(job.request_id), disconnected, headers,
                                 gw.settings.sse_keepalive_interval, sse_error)
        return EventStreamResponse(events, disconnected, headers)

    async def _reply(self, gen: Generation, headers: dict[str, str]) -> Response:
        blocks, choice = Blocks(), ChoiceEvents(gen.job)
        finish: str | None = None
        try:
            async for piece in gen:
                if piece is None:
                    continue
                if piece.finish_reason in (FINISH_ERROR, FINISH_ABORT):
                    return anthropic_error_response(ended_error(piece))
                blocks.feed(choice.feed(piece))
                finish = piece.finish_reason or finish
        finally:
            await self._close(gen)
        if finish is None:
            return anthropic_error_response(_NO_END)
        blocks.finish()
        job = gen.job
        stop = gen.stop_string()
        reply = MessageReply(job.request_id, job.model, blocks.content,
                             blocks.stop_reason(choice.finish_reason(finish), stop), stop,
                             _usage(gen))
        return json_response(reply, headers)

    async def _events(self, gen: Generation, first: list[Piece | None],
                      pieces: AsyncGenerator[Piece | None]) -> AsyncIterator[bytes]:
        """message_start (at the first output, when the prefix-cache hit is known), the
        blocks' events, then message_delta + message_stop, or one `error` event."""
        blocks, choice = Blocks(), ChoiceEvents(gen.job)
        started = False
        try:
            async for piece in prepend(first, pieces):
                if piece is None:
                    yield sse(Ping())
                    continue
                if piece.finish_reason in (FINISH_ERROR, FINISH_ABORT):
                    yield sse_error(ended_error(piece))
                    return
                if not started:
                    started = True
                    yield sse(MessageStart(self._shell(gen)))
                for event in blocks.feed(choice.feed(piece)):
                    yield sse(event)
                if piece.finish_reason is not None:
                    for event in blocks.finish():
                        yield sse(event)
                    stop = gen.stop_string()
                    reason = choice.finish_reason(piece.finish_reason)
                    delta = StopDelta(blocks.stop_reason(reason, stop), stop)
                    yield sse(MessageDelta(delta, _usage(gen)))
                    yield sse(MessageStop())
                    return
            yield sse_error(_NO_END)  # NOTE: never left without a terminal event
        finally:
            await pieces.aclose()
            await self._close(gen)

    def _shell(self, gen: Generation) -> MessageReply:
        """The message as message_start shows it: no content, no stop reason yet."""
        return MessageReply(gen.job.request_id, gen.job.model, [], None, None, _usage(gen))

    async def _close(self, gen: Generation) -> None:
        await gen.aclose()
        self.gw.finished(gen)


_NO_END = ApiError(500, "the engine stream ended without a final output", "engine_error")


def _usage(gen: Generation) -> MessageUsage:
    """Anthropic's count: input_tokens are the prompt tokens not read from the prefix cache."""
    prompt, cached = len(gen.job.prompt_ids), gen.cached_tokens
    return MessageUsage(prompt - cached, gen.completion_tokens, cached)
