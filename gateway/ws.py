"""WebSocket `/v1/ws`, subprotocol `pagedserve.v1`: many generations per socket (docs/websocket.md).

Each socket is a `Session` with an explicit state; generations push frames into a bounded
`Outbox` that one sender task drains, so a slow reader never blocks other sockets or streams.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import msgspec
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway import resumable_ws as ws_stream
from gateway.auth import bearer_ok
from gateway.chunks import ChunkBuilder, timeline_of, usage_of
from gateway.errors import ApiError
from gateway.generation import Generation, piece_error
from gateway.requests import ChatCompletionRequest, RequestId
from gateway.resumable import ResumableStream
from gateway.resumable_sse import wants_resumable
from gateway.service import Gateway
from gateway.tracing import trace_headers
from gateway.validate import decode_request
from ipc.messages import FINISH_ABORT, FINISH_ERROR

SUBPROTOCOL = "pagedserve.v1"
MAX_GENERATIONS_PER_SOCKET = 64
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008


class Generate(msgspec.Struct, tag="generate"):
    id: RequestId  # NOTE: echoed in every frame of the generation: bounded like request_id
    request: msgspec.Raw


class Cancel(msgspec.Struct, tag="cancel"):
    id: RequestId


class Ping(msgspec.Struct, tag="ping"):
    pass


class Resume(msgspec.Struct, tag="resume"):
    id: RequestId  # the id its frames carry on this socket
    stream_id: str  # from its generation.started
    after_seq: int = -1  # the last delta seq received


_frames = msgspec.json.Decoder(Generate | Cancel | Ping | Resume)


class State(enum.IntEnum):
    CONNECTING = 0  # handshake checks (origin, auth) not yet passed
    OPEN = 1  # accepts generate frames
    DRAINING = 2  # server shutting down: running generations finish, new ones are refused
    CLOSED = 3  # socket gone: every generation aborted, frames dropped


class Outbox:
    """Frames waiting to be sent. A delta for an id whose previous delta is still queued is
    merged into it (the reader is behind); past `max_frames` or `max_chars` it overflows."""

    def __init__(self, max_frames: int, max_chars: int = 1 << 20) -> None:
        self._frames: deque[dict[str, Any]] = deque()
        self._open_delta: dict[str, dict[str, Any]] = {}
        self._chars = 0
        self._max_frames = max_frames
        self._max_chars = max_chars
        self._wake = asyncio.Event()
        self.overflow = asyncio.Event()  # set once past the bound: the socket must close

    def __len__(self) -> int:
        return len(self._frames)

    def push(self, frame: dict[str, Any]) -> None:
        gen_id = frame.get("id")
        if frame["type"] == "generation.delta":
            queued = self._open_delta.get(gen_id)  # type: ignore[arg-type]
            if queued is not None:
                self._chars += _merge_chunk(queued["chunk"], frame["chunk"])
                if "seq" in frame:  # NOTE: a resumable generation's: the last merged one
                    queued["seq"] = frame["seq"]
                self._check()
                return
            self._open_delta[gen_id] = frame  # type: ignore[index]
            self._chars += _chunk_chars(frame["chunk"])
        elif gen_id is not None:
            self._open_delta.pop(gen_id, None)  # NOTE: nothing merges past a done/error frame
        self._frames.append(frame)
        self._wake.set()
        self._check()

    @property
    def overflowed(self) -> bool:
        return self.overflow.is_set()

    async def pop(self) -> dict[str, Any] | None:
        """The next frame, or None once the outbox overflowed (the socket must close)."""
        while not self._frames and not self.overflowed:
            self._wake.clear()
            await self._wake.wait()
        if self.overflowed:
            return None
        frame = self._frames.popleft()
        if frame["type"] == "generation.delta":
            if self._open_delta.get(frame["id"]) is frame:
                del self._open_delta[frame["id"]]
            self._chars -= _chunk_chars(frame["chunk"])
        return frame

    def _check(self) -> None:
        if len(self._frames) > self._max_frames or self._chars > self._max_chars:
            self.overflow.set()
            self._wake.set()


# NOTE: the delta fields that carry text; merged deltas concatenate them
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


def _chunk_chars(chunk: dict[str, Any]) -> int:
    return sum(_delta_chars(c.get("delta", {})) for c in chunk.get("choices", []))


def _delta_chars(delta: dict[str, Any]) -> int:
    return sum(len(delta.get(f) or "") for f in _TEXT_FIELDS)


def _merge_chunk(into: dict[str, Any], new: dict[str, Any]) -> int:
    """Append `new`'s text and logprobs to `into`, choice by choice (index); returns the
    characters added."""
    added = 0
    for new_choice in new.get("choices", []):
        old_choice = next((c for c in into.setdefault("choices", [])
                           if c["index"] == new_choice["index"]), None)
        if old_choice is None:
            into["choices"].append(new_choice)
            added += _delta_chars(new_choice["delta"])
            continue
        new_delta, old_delta = new_choice["delta"], old_choice["delta"]
        for name in _TEXT_FIELDS:
            if new_delta.get(name):
                old_delta[name] = (old_delta.get(name) or "") + new_delta[name]
        if new_delta.get("tool_calls"):  # NOTE: clients join a call's fragments by index
            old_delta.setdefault("tool_calls", []).extend(new_delta["tool_calls"])
        if new_choice.get("logprobs"):
            if old_choice.get("logprobs"):
                old_choice["logprobs"]["content"].extend(new_choice["logprobs"]["content"])
            else:
                old_choice["logprobs"] = new_choice["logprobs"]
        old_choice["finish_reason"] = (new_choice.get("finish_reason")
                                       or old_choice["finish_reason"])
        added += _delta_chars(new_delta)
    if "timeline" in new:
        into["timeline"] = new["timeline"]
    return added


class WebSocketEndpoint:
    """ASGI endpoint: one Session per connection."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await Session(self.gw, WebSocket(scope, receive, send)).run()


class Session:
    def __init__(self, gateway: Gateway, websocket: WebSocket) -> None:
        self.gw = gateway
        self.ws = websocket
        self.state = State.CONNECTING
        self.id = f"sess-{uuid.uuid4().hex[:16]}"
        self.outbox = Outbox(gateway.settings.ws_send_queue)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.endings: set[asyncio.Future[None]] = set()  # see _task_done
        self.seq: dict[str, int] = {}
        self.owner = b""  # digest of the key it presented (resumable streams are bound to it)
        self.producing: dict[str, ResumableStream] = {}  # resumable generations started here
        self.following: dict[str, ResumableStream] = {}  # resumable generations sent here

    async def run(self) -> None:
        problem = self._handshake_problem()
        if problem is not None:
            await self.ws.close(code=CLOSE_POLICY, reason=problem)
            return
        offered = self.ws.scope.get("subprotocols", [])
        self.owner = ws_stream.socket_owner(self.ws.headers.get("authorization", ""), offered)
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        self.state = State.DRAINING if self.gw.draining else State.OPEN
        self.gw.drain_listeners.append(self._on_drain)
        sender = asyncio.create_task(self._send_loop())
        self.push({"type": "session.created", "session_id": self.id, "protocol": SUBPROTOCOL,
                   "model": self.gw.model_name})
        if self.state is State.DRAINING:
            self.push({"type": "session.draining"})
        receiver = asyncio.create_task(self._receive_loop())
        # NOTE: the overflow is watched on its own: the sender may be stuck in a send to a
        # reader that stopped reading, and the socket must close (and its generations end) now.
        overflow = asyncio.create_task(self.outbox.overflow.wait())
        try:
            await asyncio.wait({receiver, sender, overflow}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            receiver.cancel()
            overflow.cancel()
            await self._close(sender)

    # ---- handshake ----------------------------------------------------------------------

    def _handshake_problem(self) -> str | None:
        headers = self.ws.headers
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return "origin not allowed"
        key = self.gw.settings.api_key
        if key is None:
            return None
        auth = headers.get("authorization", "").encode()
        tokens = [p[len("bearer."):] for p in self.ws.scope.get("subprotocols", [])
                  if p.startswith("bearer.")]
        if bearer_ok(auth, key.encode()) or any(
            bearer_ok(b"Bearer " + t.encode(), key.encode()) for t in tokens
        ):
            return None
        return "missing or invalid API key"

    def _origin_allowed(self, origin: str, host: str) -> bool:
        allowed = self.gw.settings.allowed_origins
        if "*" in allowed or origin in allowed:
            return True
        return not allowed and urlsplit(origin).netloc == host  # same origin by default

    # ---- frames in ----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while self.state is not State.CLOSED:
            try:
                message = await self.ws.receive()
            except WebSocketDisconnect:
                return
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            if data is None:
                self._error(None, ApiError(400, "frames must be JSON text", "invalid_frame"))
                continue
            await self._handle(data)

    async def _handle(self, data: str) -> None:
        try:
            frame = _frames.decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            param = "id" if "`$.id`" in str(exc) else None
            self._error(None, ApiError(400, f"invalid frame: {exc}", "invalid_frame", param))
            return
        match frame:
            case Ping():
                self.push({"type": "pong"})
            case Cancel(id=gen_id) if gen_id in self.following:
                self.following[gen_id].cancel()  # NOTE: ends through the engine, as a drop
            case Cancel(id=gen_id):
                task = self.tasks.get(gen_id)
                if task is None:
                    self._error(gen_id, ApiError(404, f"no running generation `{gen_id}`",
                                                 "generation_not_found"))
                else:
                    task.cancel()
            case Generate(id=gen_id, request=raw):
                await self._start(gen_id, raw)
            case Resume(id=gen_id, stream_id=stream_id, after_seq=after):
                self._resume(gen_id, stream_id, after)

    async def _start(self, gen_id: str, raw: msgspec.Raw) -> None:
        try:
            if self.state is State.DRAINING:
                raise ApiError(503, "the server is shutting down", "server_draining")
            if gen_id in self.tasks or gen_id in self.producing:
                raise ApiError(400, f"generation `{gen_id}` is running", "duplicate_id", "id")
            if len(self.tasks) >= MAX_GENERATIONS_PER_SOCKET:
                raise ApiError(429, "too many generations on this socket", "too_many_generations")
            request = decode_request(bytes(raw), ChatCompletionRequest)
            job = await self.gw.prepare(request)
            job.trace_headers = trace_headers(self.ws.headers)  # the handshake's
            gen = self.gw.start(job)
        except ApiError as exc:
            self._error(gen_id, exc)
            return
        self.seq[gen_id] = 0
        if wants_resumable(request.resumable, self.gw.settings.resumable_streams, True):
            self._start_resumable(gen_id, gen)
            return
        self.push({"type": "generation.started", "id": gen_id, "request_id": gen.job.request_id})
        task = asyncio.create_task(self._run(gen_id, gen))
        self.tasks[gen_id] = task
        task.add_done_callback(lambda t: self._task_done(gen_id, gen, t))

    # ---- resumable generations (gateway/resumable_ws.py) -------------------------------

    def _start_resumable(self, gen_id: str, gen: Generation) -> None:
        """Run the generation on a stream of its own (a closed socket no longer ends it) and
        follow that stream here."""
        stream = self.gw.streams.open(ws_stream.KIND, self.owner,
                                      lambda s: self._run(gen_id, gen),
                                      lambda: self.gw.cancel(gen.job.request_id))
        stream.meta["request_id"] = gen.job.request_id
        self.producing[gen_id] = stream
        self.push({"type": "generation.started", "id": gen_id, "request_id": gen.job.request_id,
                   "stream_id": stream.id})
        self._follow(gen_id, stream, -1)

    def _resume(self, gen_id: str, stream_id: str, after: int) -> None:
        try:
            if gen_id in self.tasks:
                raise ApiError(400, f"generation `{gen_id}` is running", "duplicate_id", "id")
            if len(self.tasks) >= MAX_GENERATIONS_PER_SOCKET:
                raise ApiError(429, "too many generations on this socket", "too_many_generations")
            stream = self.gw.streams.find(stream_id, ws_stream.KIND, self.owner)
            stream.check_after(after, "after_seq")
        except ApiError as exc:
            self._error(gen_id, exc)
            return
        self.gw.streams.resumed()
        self.push({"type": "generation.resumed", "id": gen_id, "stream_id": stream_id,
                   "request_id": stream.meta["request_id"], "after_seq": after})
        self._follow(gen_id, stream, after)

    def _follow(self, gen_id: str, stream: ResumableStream, after: int) -> None:
        async def forward() -> None:
            async for frame in ws_stream.follow(stream, after, gen_id):
                self._deliver(frame)

        task = asyncio.create_task(forward())
        self.tasks[gen_id] = task
        self.following[gen_id] = stream

        def done(t: asyncio.Task[None]) -> None:
            if self.tasks.get(gen_id) is t:
                del self.tasks[gen_id]
                del self.following[gen_id]

        task.add_done_callback(done)

    # ---- generations --------------------------------------------------------------------

    async def _run(self, gen_id: str, gen: Generation) -> None:
        builder = ChunkBuilder(gen, self.gw.namer(gen.job.model))
        error: ApiError | None = None
        try:
            async for piece in gen:
                if piece is None:
                    continue
                if piece.finish_reason == FINISH_ERROR:
                    error = piece_error(piece)
                    break
                chunk = builder.chunk(piece)
                if chunk is not None:
                    self.push({"type": "generation.delta", "id": gen_id,
                               "chunk": msgspec.to_builtins(chunk)})
        except asyncio.CancelledError:
            pass  # NOTE: only this session cancels these tasks (cancel frame, close)
        await self._end(gen_id, gen, error, builder)

    def _task_done(self, gen_id: str, gen: Generation, task: asyncio.Task[None]) -> None:
        """Every generation task ends here. One cancelled before its first step never ran
        `_run` (a `cancel` right after its `generate`): it is ended from a task of its own."""
        if self.tasks.get(gen_id) is task:
            del self.tasks[gen_id]
        if not gen.closed:
            ending = asyncio.ensure_future(self._end(gen_id, gen, None))
            self.endings.add(ending)
            ending.add_done_callback(self.endings.discard)

    async def _end(self, gen_id: str, gen: Generation, error: ApiError | None,
                   builder: ChunkBuilder | None = None) -> None:
        """Abort and count the request, free its id, and send its one terminal frame (its
        finish reasons as the chunks said them, when it streamed any)."""
        try:
            await gen.aclose()
        finally:
            self.gw.finished(gen)
            if self.tasks.get(gen_id) is asyncio.current_task():
                del self.tasks[gen_id]
        if error is not None:
            self._error(gen_id, error)
            return
        status = "cancelled" if gen.finish_reason == FINISH_ABORT else "completed"
        reason = builder.finish_reason if builder is not None else lambda r, i=0: r
        reasoning = builder.reasoning_tokens if builder is not None else None
        self.push({"type": "generation.done", "id": gen_id, "status": status,
                   "finish_reason": reason(gen.finish_reason),
                   "finish_reasons": [reason(r, i) for i, r in
                                      enumerate(gen.choice_finish_reasons)],
                   "usage": msgspec.to_builtins(usage_of(gen, reasoning_tokens=reasoning)),
                   "timeline": msgspec.to_builtins(timeline_of(gen))})

    # ---- frames out ---------------------------------------------------------------------

    def push(self, frame: dict[str, Any]) -> None:
        stream = self.producing.get(frame.get("id"))  # type: ignore[arg-type]
        if stream is not None and frame["type"] in ws_stream.RECORDED:
            if ws_stream.record(stream, frame):
                del self.producing[frame["id"]]
            return
        self._deliver(frame)

    def _deliver(self, frame: dict[str, Any]) -> None:
        if self.state is not State.CLOSED:
            self.outbox.push(frame)

    def _error(self, gen_id: str | None, error: ApiError) -> None:
        frame: dict[str, Any] = {"type": "error", "error": msgspec.to_builtins(error.body)}
        if gen_id is not None:
            frame["id"] = gen_id
        self.push(frame)

    async def _send_loop(self) -> None:
        while (frame := await self.outbox.pop()) is not None:
            if frame["type"] == "generation.delta" and "seq" not in frame:
                frame["seq"] = self.seq[frame["id"]]
                self.seq[frame["id"]] += 1
            await self.ws.send_text(msgspec.json.encode(frame).decode())

    def _on_drain(self) -> None:
        if self.state is State.OPEN:
            self.state = State.DRAINING
            self.push({"type": "session.draining"})

    async def _close(self, sender: asyncio.Task[None]) -> None:
        overflowed = self.outbox.overflowed
        self.state = State.CLOSED
        if self._on_drain in self.gw.drain_listeners:
            self.gw.drain_listeners.remove(self._on_drain)
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        sender.cancel()
        await asyncio.gather(sender, *tasks, return_exceptions=True)
        await asyncio.gather(*list(self.endings), return_exceptions=True)
        # NOTE: a send that failed because the peer left ends the sender with an error; that
        # is a normal close, and the receive side reports it too.
        if overflowed:
            await self._try_close(CLOSE_TRY_AGAIN_LATER, "reader too slow")

    async def _try_close(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code=code, reason=reason)
        except (RuntimeError, OSError, WebSocketDisconnect):
            return  # NOTE: already closed by the peer; nothing left to tell it
