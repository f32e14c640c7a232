"""The gateway's handle on one engine process: spawn, hand-shake, route outputs, supervise.

asyncio only. It never imports torch or the engine package: the engine runs as `python -m engine`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import ipc
from gateway.engine_sockets import EngineUnavailableError, SocketPump, ready_within
from ipc.config import EngineConfig
from ipc.engine_timeouts import EngineTimeouts
from ipc.messages import (
    FINISH_ERROR,
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    FromEngine,
    Heartbeat,
    LoadLoraAdapter,
    LoraAdapterResult,
    Shutdown,
    StepOutputs,
    ToEngine,
    TokenDelta,
    UnloadLoraAdapter,
)
from ipc.transport import GatewaySockets

log = logging.getLogger("gateway.engine_client")

_RESTART_DELAY_S = (0.5, 15.0)  # first and largest back-off between restarts
_EXIT_GRACE_S = 0.2  # after a clean exit, time for its last outputs to arrive


class RequestStream:
    """Async iterator of one request's TokenDeltas; it ends right after the last terminal
    delta: one per choice (n > 1 has n), or the first error."""

    def __init__(self, request_id: str, on_close: Callable[[str], None],
                 num_choices: int = 1) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._on_close = on_close
        self._open_queued = num_choices  # choices whose terminal delta is not queued yet
        self._open_seen = num_choices  # choices whose terminal delta the consumer has not seen
        self._terminal_queued = False  # nothing more will be queued
        self._done = False  # the consumer has seen the terminal delta (or closed)

    @property
    def finished(self) -> bool:
        """True once the terminal delta has been received (or the stream was closed)."""
        return self._terminal_queued

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        self._open_seen = _still_open(self._open_seen, delta)
        self._done = self._open_seen == 0
        return delta

    async def aclose(self) -> None:
        """Stop listening; aborts the request in the engine if it has not finished."""
        if not self._terminal_queued:
            self._terminal_queued = True
            self._on_close(self.request_id)
        self._done = True

    def _put(self, delta: TokenDelta) -> None:
        if self._terminal_queued:
            return
        self._open_queued = _still_open(self._open_queued, delta)
        self._terminal_queued = self._open_queued == 0
        self._queue.put_nowait(delta)


def _still_open(num_open: int, delta: TokenDelta) -> int:
    """Choices still running after `delta` (an error ends them all)."""
    if delta.finish_reason == FINISH_ERROR:
        return 0
    return num_open - 1 if delta.finished else num_open


class EngineClient:
    """One engine behind ZeroMQ. `spawn=False` waits for an engine started elsewhere."""

    def __init__(self, config: EngineConfig, *,
                 heartbeat_timeout: float = EngineTimeouts.heartbeat_timeout,
                 restart: bool = True, input_addr: str | None = None,
                 output_addr: str | None = None, spawn: bool = True,
                 startup_timeout: float = EngineTimeouts.startup_timeout,
                 heartbeat_interval: float = EngineTimeouts.heartbeat_interval,
                 engine_command: Sequence[str] | None = None,
                 sockets: GatewaySockets | None = None) -> None:
        """`engine_command` is the argv prefix that starts an engine (default: python -m
        engine); the config, addresses and incarnation flags are appended to it. `sockets`:
        shared with other clients (gateway.engine_pool), which then owns them and feeds this
        client through `on_handshake` / `on_output`."""
        self.config = config
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.startup_timeout = startup_timeout
        self.restart = restart
        self.spawn = spawn
        self._addrs = (input_addr, output_addr)
        self._command = list(engine_command or [sys.executable, "-m", "engine"])
        self.info: EngineReady | None = None  # the current engine's handshake
        self.stats: EngineStats | None = None  # latest stats from the current engine
        self.last_error: str | None = None  # why the engine last died
        self.restarts = 0  # engines started after the first
        self._ready = asyncio.Event()
        self._sockets: GatewaySockets | None = sockets
        self._shared = sockets is not None
        self._pump: SocketPump | None = None  # its own sockets (not shared)
        self._proc: asyncio.subprocess.Process | None = None
        self._spawning: asyncio.Future[None] | None = None  # the spawn in flight (_launch)
        self._incarnation: str | None = None
        self._identity: bytes | None = None
        self._dead: set[str] = set()
        self._launched_at = 0.0
        self._last_seen = 0.0
        self._streams: dict[str, RequestStream] = {}
        # LoRA load/unload requests waiting for the engine's LoraAdapterResult, by request id
        self._lora_waiters: dict[str, asyncio.Future[LoraAdapterResult]] = {}
        self._pending_aborts: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._first_ready: asyncio.Future[None] | None = None
        self._restart_delay = _RESTART_DELAY_S[0]
        self._closing = False

    # ---- state --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until an engine is ready (raises TimeoutError)."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    @property
    def input_addr(self) -> str:
        assert self._sockets is not None, "start() first"
        return self._sockets.input_addr

    @property
    def output_addr(self) -> str:
        assert self._sockets is not None, "start() first"
        return self._sockets.output_addr

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind, spawn the engine and wait for its EngineReady (EngineUnavailableError if it
        dies or takes longer than startup_timeout first)."""
        if not self._shared:
            self._pump = SocketPump(*self._addrs, self.on_handshake, self.on_output)
            self._sockets = self._pump.open()
        self._first_ready = asyncio.get_running_loop().create_future()
        self._spawn_task(self._watchdog())
        if self.spawn:
            await self._launch()
        await ready_within(asyncio.shield(self._first_ready), self.startup_timeout,
                           "engine not ready", lambda: self.close(timeout=0))

    async def close(self, timeout: float = 10.0) -> None:
        """Shutdown(timeout) to the engine, wait for it, then kill its process group."""
        if self._closing:
            return
        self._closing = True
        self._ready.clear()
        if self._first_ready is not None and not self._first_ready.done():
            self._first_ready.set_exception(EngineUnavailableError("closed before ready"))
            self._first_ready.exception()  # NOTE: marks it retrieved if start() was cancelled
        if self._spawning is not None:  # NOTE: an engine forked while start() was cancelled
            await asyncio.gather(self._spawning, return_exceptions=True)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            if self._identity is not None:
                self._send(Shutdown(timeout=timeout))
            else:
                _killpg(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout + 5.0)
            except TimeoutError:
                log.error("engine %d did not exit in time; killing it", proc.pid)
                _killpg(proc, signal.SIGKILL)
                await proc.wait()
            await asyncio.sleep(_EXIT_GRACE_S)  # NOTE: let its last outputs be routed
        if proc is not None:
            _killpg(proc, signal.SIGKILL)  # NOTE: anything it left behind in its group
        self._fail_all("engine shut down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._proc is not None and self._proc is not proc:  # NOTE: a restart raced us
            _killpg(self._proc, signal.SIGKILL)
            await self._proc.wait()
        if self._pump is not None:
            await self._pump.close()

    # ---- requests -----------------------------------------------------------------------

    def submit(self, msg: AddRequest) -> RequestStream:
        """Send a request; its stream yields deltas until exactly one terminal delta."""
        if self._closing:
            raise EngineUnavailableError("engine is shutting down")
        if not self.ready or self._identity is None:
            raise EngineUnavailableError(self.last_error or "engine is not ready")
        if msg.request_id in self._streams:
            raise ValueError(f"request_id {msg.request_id!r} is already in flight")
        stream = RequestStream(msg.request_id, self._close_stream, msg.sampling.num_choices)
        self._streams[msg.request_id] = stream
        self._send(msg)
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the engine to abort; idempotent. The stream then ends with an 'abort' delta."""
        if request_id in self._streams and request_id not in self._pending_aborts:
            self._queue_abort(request_id)

    def abort_choice(self, request_id: str, index: int) -> None:
        """Stop one choice of an n > 1 request (it matched a stop string); the stream still
        gets that choice's terminal delta."""
        if request_id in self._streams and self._identity is not None:
            self._send(AbortRequests(request_ids=[request_id], index=index))

    async def lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterResult:
        """Load or unload a LoRA adapter in the engine; its answer."""
        if not self.ready or self._identity is None:
            raise EngineUnavailableError(self.last_error or "engine is not ready")
        waiter = asyncio.get_running_loop().create_future()
        self._lora_waiters[msg.request_id] = waiter
        self._send(msg)
        try:
            return await waiter
        finally:
            self._lora_waiters.pop(msg.request_id, None)

    def _close_stream(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._queue_abort(request_id)

    def _queue_abort(self, request_id: str) -> None:
        # NOTE: aborts issued in one event-loop turn (a socket closing with many generations)
        # travel as one AbortRequests message.
        if not self._pending_aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts)
        self._pending_aborts.append(request_id)

    def _flush_aborts(self) -> None:
        ids, self._pending_aborts = self._pending_aborts, []
        if ids and self._identity is not None:
            self._send(AbortRequests(request_ids=ids))

    def _send(self, msg: ToEngine) -> None:
        assert self._sockets is not None and self._identity is not None
        self._sockets.send(self._identity, msg)

    # ---- engine -> gateway --------------------------------------------------------------

    def on_handshake(self, identity: bytes, ready: EngineReady) -> bool:
        """Adopt this engine if it is the one we wait for; True when adopted."""
        # NOTE: engines repeat EngineReady about once a second; only a new one counts.
        if self.ready or self._closing or ready.incarnation in self._dead:
            return False
        if self.spawn and ready.incarnation != self._incarnation:
            return False  # an engine we did not start, or an old one of ours
        self._on_ready(identity, ready)
        return True

    def attach(self, identity: bytes, ready: EngineReady) -> None:
        """Adopt an engine that attached itself to shared sockets (no start() needed)."""
        assert self._shared and not self.spawn
        self._first_ready = asyncio.get_running_loop().create_future()
        self._spawn_task(self._watchdog())
        self._on_ready(identity, ready)

    @property
    def incarnation(self) -> str | None:
        return self._incarnation

    @property
    def engine_stats(self) -> list[tuple[str, EngineStats | None]]:
        """(name, latest stats) of each live engine: this one (the live view's feed)."""
        return [("engine 0", self.stats)] if self.ready else []

    @property
    def dead(self) -> bool:
        """The current engine died (or closed) and no new one is ready."""
        return self._incarnation is None or self._incarnation in self._dead

    def _on_ready(self, identity: bytes, ready: EngineReady) -> None:
        self._incarnation, self._identity, self.info = ready.incarnation, identity, ready
        self._last_seen = time.monotonic()
        self._restart_delay = _RESTART_DELAY_S[0]
        self._ready.set()
        log.info("engine %s ready: %s", ready.incarnation, ready.model)
        if self._first_ready is not None and not self._first_ready.done():
            self._first_ready.set_result(None)

    def on_output(self, msg: FromEngine) -> None:
        if msg.incarnation != self._incarnation or msg.incarnation in self._dead:
            return  # NOTE: outputs of an old (or not yet adopted) engine are dropped
        match msg:
            case StepOutputs(deltas=deltas, stats=stats):
                self._seen(stats)
                self._route(deltas)
            case Heartbeat(stats=stats):
                self._seen(stats)
            case EngineDead(reason=reason):
                # NOTE: it exits by itself after saying so; kill it only if it lingers.
                self._on_death(msg.incarnation, reason, kill_after=5.0)
            case EngineReady():
                log.warning("EngineReady on the output socket ignored")
            case LoraAdapterResult(request_id=rid):
                waiter = self._lora_waiters.get(rid)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)

    def _seen(self, stats: EngineStats | None) -> None:
        self._last_seen = time.monotonic()
        if stats is not None:
            self.stats = stats

    def _route(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # closed by the consumer; its abort is on the way
            stream._put(delta)
            if stream.finished:
                del self._streams[delta.request_id]

    # ---- supervision --------------------------------------------------------------------

    async def _watchdog(self) -> None:
        period = min(0.5, self.heartbeat_timeout / 5)
        while True:
            await asyncio.sleep(period)
            now, inc = time.monotonic(), self._incarnation
            if inc is None or inc in self._dead or self._closing:
                continue
            if self.ready and now - self._last_seen > self.heartbeat_timeout:
                self._on_death(inc, f"no heartbeat for {now - self._last_seen:.1f} s")
            elif not self.ready and self.spawn and now - self._launched_at > self.startup_timeout:
                self._on_death(inc, f"not ready within {self.startup_timeout:g} s")

    async def _watch_exit(self, proc: asyncio.subprocess.Process, incarnation: str) -> None:
        code = await proc.wait()
        if code == 0:
            await asyncio.sleep(_EXIT_GRACE_S)  # NOTE: its EngineDead may still be in flight
        self._on_death(incarnation, f"process exited with code {code}")

    def _on_death(self, incarnation: str, reason: str, kill_after: float = 0.0) -> None:
        if incarnation != self._incarnation or incarnation in self._dead:
            return
        self._dead.add(incarnation)
        self.last_error = reason
        self._ready.clear()
        self._identity = None
        self._pending_aborts.clear()
        if self._closing:  # NOTE: the gateway stopped it: no death to report
            log.info("engine %s stopped: %s", incarnation, reason)
        else:
            log.error("engine %s died: %s", incarnation, reason)
        self._fail_all(f"engine died: {reason}")
        if self._proc is not None:
            self._spawn_task(_reap(self._proc, kill_after))
        if self._first_ready is not None and not self._first_ready.done():
            self._first_ready.set_exception(EngineUnavailableError(f"engine died: {reason}"))
        elif self.restart and self.spawn and not self._closing:
            self._spawn_task(self._restart_later())

    def _fail_all(self, error: str) -> None:
        for waiter in self._lora_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineUnavailableError(error))
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream._put(TokenDelta(request_id=rid, finish_reason=FINISH_ERROR, error=error))

    async def _restart_later(self) -> None:
        delay, self._restart_delay = self._restart_delay, min(self._restart_delay * 2,
                                                              _RESTART_DELAY_S[1])
        await asyncio.sleep(delay)
        if self._proc is not None:
            await self._proc.wait()  # NOTE: the old engine's memory must be free first
        if not self._closing:
            self.restarts += 1
            await self._launch()

    async def _launch(self) -> None:
        assert self._sockets is not None
        if self._closing:
            return
        self._incarnation = uuid.uuid4().hex[:12]
        argv = [*self._command, *self.config.to_cli_args(),
                "--input-addr", self._sockets.input_addr,
                "--output-addr", self._sockets.output_addr,
                "--incarnation", self._incarnation,
                "--heartbeat-interval", str(self.heartbeat_interval),
                "--parent-pid", str(os.getpid())]
        self._launched_at = time.monotonic()
        # NOTE: shielded, and close() waits for it: a start() cancelled mid-spawn (the web
        # stack's import failed) must still leave close() the process it forked to kill
        self._spawning = asyncio.ensure_future(self._spawn(argv))
        await asyncio.shield(self._spawning)
        log.info("started engine %s (pid %d)", self._incarnation, self._proc.pid)
        self._spawn_task(self._watch_exit(self._proc, self._incarnation))

    async def _spawn(self, argv: list[str]) -> None:
        try:
            # NOTE: its own session, so that killing its process group takes every child
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, env=_child_env(),
                start_new_session=True)
        finally:
            self._spawning = None

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine client task failed", exc_info=task.exception())


def _child_env() -> dict[str, str]:
    # NOTE: the engine package sits next to ipc; a source checkout is not installed, so put
    # its root on the child's path (harmless when it is installed).
    root = str(Path(ipc.__file__).resolve().parents[1])
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # NOTE: systemd's, ours only
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


async def _reap(proc: asyncio.subprocess.Process, grace: float) -> None:
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        pass  # NOTE: killed just below
    _killpg(proc, signal.SIGKILL)
    await proc.wait()


def _killpg(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # NOTE: already gone
