"""A scripted EngineClient double and an in-loop uvicorn runner for gateway tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

from ipc.messages import (
    AddRequest,
    EngineReady,
    EngineStats,
    LoadLoraAdapter,
    LoraAdapterResult,
    PositionLogprobs,
    RequestMetrics,
    TokenDelta,
    TokenLogprob,
    UnloadLoraAdapter,
)
from ipc.pooling import PoolingInfo


class FakeStream:
    """Yields TokenDeltas the FakeEngine feeds it; ends after the terminal one."""

    def __init__(self, engine: FakeEngine, msg: AddRequest) -> None:
        self.request_id = msg.request_id
        self.queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.done = False
        self._open = msg.sampling.num_choices
        self._engine = engine

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finished:
            self._open = 0 if delta.finish_reason in ("abort", "error") else self._open - 1
        self.done = self._open == 0
        return delta

    async def aclose(self) -> None:
        if not self.done:
            self._engine.abort(self.request_id)


# what the fake engine reports for every request it finishes (RequestMetrics counts)
FAKE_COUNTS = dict(num_preemptions=1, num_recomputed_tokens=3, num_spec_draft_tokens=4,
                   num_spec_accepted_tokens=2)


class FakeEngine:
    """Answers each request with `reply` (text) one token per `interval`, like the engine would:
    length at max_tokens, stop at the end of the reply, abort on abort, error on `kill()`."""

    def __init__(self, tokenizer_dir: Path, reply: str = "Hello there, how are you today?",
                 interval: float = 0.01, max_model_len: int = 256,
                 max_num_seqs: int = 0) -> None:
        from gateway.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(tokenizer_dir)
        self.reply_ids = self.tokenizer.encode(reply)
        self.interval = interval
        self.first_delay = 0.0
        self.ready = True
        self.pid: int | None = None  # no engine process
        self.info: EngineReady | None = EngineReady(
            model="test-model", max_model_len=max_model_len, block_size=16, num_gpu_blocks=64,
            tokenizer=str(tokenizer_dir), incarnation="fake-1", max_num_seqs=max_num_seqs,
            pooling=PoolingInfo(dimensions=8),
        )
        self.stats: EngineStats | None = EngineStats(kv_blocks_total=64, kv_blocks_free=64)
        self.submitted: list[AddRequest] = []
        self.aborted: list[str] = []
        self.aborted_choices: list[tuple[str, int]] = []
        self.streams: dict[str, FakeStream] = {}
        self.lora_names: set[str] = set()  # adapters loaded through lora()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def engine_stats(self) -> list[tuple[str, EngineStats | None]]:
        return [("engine 0", self.stats)] if self.ready else []

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    async def lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterResult:
        """Accepts every load and unload (a real engine reads the directory)."""
        if isinstance(msg, LoadLoraAdapter):
            self.lora_names.add(msg.lora_name)
        else:
            self.lora_names.discard(msg.lora_name)
        return LoraAdapterResult(request_id=msg.request_id, adapters=sorted(self.lora_names))

    def submit(self, msg: AddRequest) -> FakeStream:
        if not self.ready:
            raise RuntimeError("engine not ready")
        stream = FakeStream(self, msg)
        self.submitted.append(msg)
        self.streams[msg.request_id] = stream
        self._tasks[msg.request_id] = asyncio.create_task(self._feed(msg, stream))
        self._update_stats()
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
            self.streams[request_id].queue.put_nowait(
                TokenDelta(request_id=request_id, finish_reason="abort"))
        self._update_stats()

    def abort_choice(self, request_id: str, index: int) -> None:
        self.aborted_choices.append((request_id, index))

    async def start(self) -> None:
        """Ready at once (a model loaded into a ModelRegistry)."""
        self.ready = True

    async def close(self, timeout: float = 10.0) -> None:
        """Unloaded: every running request is aborted, and it is not ready."""
        for request_id in list(self._tasks):
            self.abort(request_id)
        self.ready = False

    def kill(self) -> None:
        """The engine dies: every stream gets an error delta, and it is not ready."""
        self.ready = False
        for request_id, task in list(self._tasks.items()):
            task.cancel()
            self.streams[request_id].queue.put_nowait(
                TokenDelta(request_id=request_id, finish_reason="error", error="engine died"))
        self._tasks.clear()
        self._update_stats()

    def _update_stats(self) -> None:
        # NOTE: the first max_num_seqs requests run (their prefill is `first_delay`), the
        # rest wait, as the engine reports it
        n = len(self._tasks)
        seats = self.info.max_num_seqs if self.info and self.info.max_num_seqs else n
        running = min(n, seats)
        self.stats = EngineStats(num_running=running, num_waiting=n - running,
                                 kv_blocks_total=64, kv_blocks_free=64 - n)

    async def _feed(self, msg: AddRequest, stream: FakeStream) -> None:
        limit = msg.sampling.max_tokens or len(self.reply_ids)
        ids = self.reply_ids[:limit]
        choices = msg.sampling.num_choices
        await asyncio.sleep(self.first_delay)
        if msg.sampling.pooling is not None:  # NOTE: one terminal delta with a vector
            await asyncio.sleep(self.interval)
            vector = [float(len(msg.prompt_token_ids)), *(float(t % 7) for t in range(7))]
            stream.queue.put_nowait(TokenDelta(
                request_id=msg.request_id, finish_reason="stop", pooled=vector,
                num_prompt_tokens=len(msg.prompt_token_ids)))
            self._tasks.pop(msg.request_id, None)
            self._update_stats()
            return
        for i, token in enumerate(ids):
            await asyncio.sleep(self.interval)
            last = i == len(ids) - 1
            reason = None if not last else ("length" if len(ids) == limit else "stop")
            lp = None
            if msg.sampling.logprobs is not None:
                top = [TokenLogprob(token, -0.5)][: msg.sampling.logprobs]
                lp = [PositionLogprobs(token, -0.5, 1, top)]
            now = time.time()
            if i == 0:
                scheduled, first = now - self.interval, now
            for index in range(choices):  # NOTE: every choice says the same reply
                total = -(i + 1) * (index + 1) if msg.sampling.best_of else None
                stream.queue.put_nowait(TokenDelta(
                    request_id=msg.request_id, new_token_ids=[token], finish_reason=reason,
                    logprobs=lp, num_prompt_tokens=len(msg.prompt_token_ids), index=index,
                    cumulative_logprob=total, scheduled_time=scheduled if i == 0 else None,
                    metrics=RequestMetrics(scheduled_time=scheduled, first_token_time=first,
                                           finished_time=now, **FAKE_COUNTS) if last else None))
        self._tasks.pop(msg.request_id, None)
        self._update_stats()


@contextlib.asynccontextmanager
async def serve(app: object, send_buffer: int | None = None) -> AsyncIterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port inside this event loop.

    send_buffer: SO_SNDBUF of the listening socket, which accepted connections inherit (a
    small one makes a slow reader block the server's writes soon, whatever the kernel's
    autotuning would allow).
    """
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", loop="asyncio")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
