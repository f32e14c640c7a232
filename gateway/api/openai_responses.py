"""`POST /v1/responses` (OpenAI's Responses API, JSON and SSE), `GET` and `DELETE
/v1/responses/{response_id}`: requests run as chat requests (gateway/api/responses_request.py),
replies are written by gateway/api/responses_output.py, stored ones kept in response_store.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.api.response_store import ResponseStore
from gateway.api.responses_output import ResponseWriter
from gateway.api.responses_request import (
    check_declared,
    check_refused,
    responses_param,
    to_chat,
)
from gateway.api.responses_types import (
    DeletedResponse,
    FunctionCallItem,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)
from gateway.body import read_body
from gateway.errors import ApiError
from gateway.generation import Generation, Job, Piece, piece_error
from gateway.requests import ChatMessage, FunctionCall, ToolCall
from gateway.resumable_sse import resumable_sse, wants_resumable
from gateway.service import Gateway
from gateway.streaming import (
    PING,
    DisconnectAwareResponse,
    EventStreamResponse,
    prepend,
)
from gateway.tracing import trace_headers
from gateway.validate import check_request, decode_body
from ipc.messages import FINISH_ERROR


class ResponsesRoutes:
    """The three routes, sharing the gateway and the store of `store: true` responses."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        s = gw.settings
        self.store = ResponseStore(s.responses_store_mib * 2**20, s.responses_store_ttl)

    async def create(self, request: Request) -> Response:
        try:
            settings = self.gw.settings
            body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            parsed: ResponsesRequest = decode_body(body, ResponsesRequest)
            check_refused(body)
            check_declared(parsed)
            resumable = wants_resumable(parsed.resumable, settings.resumable_streams,
                                        parsed.stream)
            response_id = f"resp_{uuid.uuid4().hex}"
            chat, conversation = to_chat(parsed, self._history(parsed.previous_response_id),
                                         response_id)
            try:
                check_request(chat)
                job = await self.gw.prepare(chat)
            except ApiError as exc:
                raise _renamed(exc) from None
            job.trace_headers = trace_headers(request.headers)
            gen = self.gw.start(job)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            self.gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        writer = ResponseWriter(gen, _response_object(parsed, job), parsed.stream)
        keep = conversation if parsed.store is not False else None
        headers = {"X-Request-Id": response_id}
        disconnected = self.gw.metrics.client_disconnects.inc
        if not parsed.stream:
            return DisconnectAwareResponse(lambda: self._collect(gen, writer, keep, headers),
                                           disconnected)
        pieces = aiter(gen)  # NOTE: a Generation is iterated once
        first: list[Piece | None] = []
        if job.sampling.structured_outputs is not None:
            # NOTE: as chat: a grammar the engine refuses is a 400, not a stream
            piece = await anext(pieces, None)
            if piece is not None and piece.finish_reason == FINISH_ERROR:
                await pieces.aclose()  # type: ignore[attr-defined]
                await self._close(gen)
                return _renamed(piece_error(piece)).response()
            first += [piece] if piece is not None else []
        events = self._sse(gen, prepend(first, pieces), writer, keep)
        if resumable:
            return resumable_sse(self.gw.streams, events, request.headers,
                                 lambda: self.gw.cancel(response_id), disconnected, headers,
                                 settings.sse_keepalive_interval)
        return EventStreamResponse(events, disconnected, headers)

    def _history(self, previous_id: str | None) -> list[ChatMessage]:
        """The conversation a previous response ended (its input and its output)."""
        if previous_id is None:
            return []
        entry = self.store.get(previous_id)
        if entry is None:
            raise ApiError(404, f"no stored response `{previous_id}` (never stored, deleted "
                           "or expired)", "previous_response_not_found", "previous_response_id")
        return list(entry.conversation)

    async def _collect(self, gen: Generation, writer: ResponseWriter,
                       keep: list[ChatMessage] | None, headers: dict[str, str]) -> Response:
        try:
            async for piece in gen:
                if piece is None:
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    return _renamed(piece_error(piece)).response()
                writer.feed(piece)
            writer.finish(gen.finish_reason)
        finally:
            await self._close(gen)
        payload = msgspec.json.encode(writer.response)
        self._keep(writer.response, payload, keep)
        return Response(payload, headers=headers, media_type="application/json")

    async def _sse(self, gen: Generation, pieces: AsyncIterator[Piece | None],
                   writer: ResponseWriter, keep: list[ChatMessage] | None
                   ) -> AsyncIterator[bytes]:
        try:
            for event in writer.start():
                yield event
            async for piece in pieces:
                if piece is None:
                    yield PING
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    for event in writer.fail(piece.error or "the engine failed"):
                        yield event
                    return
                for event in writer.feed(piece):
                    yield event
            ending = writer.finish(gen.finish_reason)
            # NOTE: stored before the last events go out: a client that leaves at once may
            # still continue from it
            self._keep(writer.response, msgspec.json.encode(writer.response), keep)
            for event in ending:
                yield event
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
            await self._close(gen)

    def _keep(self, response: ResponseObject, payload: bytes,
              conversation: list[ChatMessage] | None) -> None:
        if conversation is not None and response.status in ("completed", "incomplete"):
            self.store.put(response.id, payload, conversation + [_assistant(response)])

    async def _close(self, gen: Generation) -> None:
        await gen.aclose()
        self.gw.finished(gen)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
            return ApiError(400, "`stream` is not supported when retrieving: the stored "
                            "response is returned whole", "unsupported_parameter",
                            "stream").response()
        entry = self.store.get(response_id)
        if entry is None:
            return _not_found(response_id).response()
        return Response(entry.response_json, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            return _not_found(response_id).response()
        return Response(msgspec.json.encode(DeletedResponse(response_id)),
                        media_type="application/json")


def _response_object(r: ResponsesRequest, job: Job) -> ResponseObject:
    """The response as it starts (status in_progress), echoing the request's settings."""
    return ResponseObject(
        id=job.request_id, created_at=job.created, model=job.model,
        instructions=r.instructions, max_output_tokens=r.max_output_tokens,
        metadata=r.metadata or {}, parallel_tool_calls=r.parallel_tool_calls is not False,
        previous_response_id=r.previous_response_id, temperature=r.temperature, top_p=r.top_p,
        tool_choice=r.tool_choice or ("auto" if r.tools else "none"), tools=r.tools or [],
        text=r.text or TextConfig(format=TextFormat(type="text")), store=r.store is not False,
        user=r.user, reasoning=r.reasoning)


def _assistant(response: ResponseObject) -> ChatMessage:
    """A response's output as the assistant turn that a later response continues."""
    text = "".join(p.text for item in response.output if isinstance(item, MessageItem)
                   for p in item.content)
    calls = [ToolCall(item.call_id, FunctionCall(item.name, item.arguments))
             for item in response.output if isinstance(item, FunctionCallItem)]
    return ChatMessage("assistant", text or None if calls else text, tool_calls=calls or None)


def _renamed(exc: ApiError) -> ApiError:
    """An error about the chat request, naming the Responses field the client sent."""
    exc.param = responses_param(exc.param)
    return exc


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response `{response_id}` (never stored, deleted or "
                    "expired)", "response_not_found", "response_id")
