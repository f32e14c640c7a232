"""The engine process: IO threads around a busy loop that drives `EngineCore.step()`.

Sockets live on two threads; the main thread only moves messages between queues and the core.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ipc import exit_codes
from ipc.config import EngineConfig
from ipc.engine_timeouts import EngineTimeouts
from ipc.messages import (
    FINISH_ABORT,
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
from ipc.pooling import PoolingInfo
from ipc.prefix_hash import pack_digest
from ipc.sd_notify import Notifier
from ipc.transport import EngineSockets

log = logging.getLogger("engine.process")

SHUTTING_DOWN = "engine is shutting down"
_IDLE_WAIT_S = 0.05  # longest block on the input queue when there is nothing to step
_IO_POLL_MS = 100  # how often the input thread checks for stop


class Core(Protocol):
    """What the loop needs from engine.core.EngineCore (and test doubles), every member
    required: the handshake and heartbeats read them as they are."""

    model_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int  # the CPU swap pool (0: none)
    eos_token_ids: list[int]
    tokenizer_dir: str
    max_num_seqs: int  # most requests it runs at once (0: not reported)
    max_logprobs: int  # most top logprobs a request may ask for
    pooling_info: PoolingInfo | None  # how it pools embeddings (None: it cannot)

    def add_request(self, msg: AddRequest) -> None: ...
    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]: ...
    def abort_choice(self, request_id: str, index: int) -> list[TokenDelta]: ...
    def step(self) -> list[TokenDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def cached_block_hashes(self) -> list[bytes]: ...  # the prefix cache's ([]: none)
    def load_lora(self, name: str, path: str) -> list[str]: ...
    def unload_lora(self, name: str) -> list[str]: ...


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    heartbeat_interval: float = EngineTimeouts.heartbeat_interval
    shutdown_timeout: float = 30.0  # grace period on SIGTERM
    parent_pid: int | None = None  # shut down if this process stops being our parent
    # NOTE: test-only hook (env PAGEDSERVE_DEBUG_HANG_AFTER_STEPS): after this many steps the
    # loop stops stepping and heart-beating, as if a step had hung, so tests can see the
    # gateway's heartbeat watchdog fire.
    hang_after_steps: int | None = None


class EngineLoop:
    """Runs one core until shutdown. `run()` returns the process exit code."""

    def __init__(self, core: Core, sockets: EngineSockets, incarnation: str,
                 options: LoopOptions | None = None, notifier: Notifier | None = None) -> None:
        self._core = core
        self._notifier = notifier or Notifier({})
        self._sockets = sockets
        self._incarnation = incarnation
        self._opts = options or LoopOptions()
        self._inputs: queue.SimpleQueue[ToEngine] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[FromEngine | None] = queue.SimpleQueue()
        self._stop_input = threading.Event()
        self._threads = [
            threading.Thread(target=self._input_thread, name="engine-input", daemon=True),
            threading.Thread(target=self._output_thread, name="engine-output", daemon=True),
        ]
        self._live: set[str] = set()  # admitted requests without a terminal delta yet
        self._steps = 0
        self._next_heartbeat = 0.0
        self._deadline: float | None = None  # set once shutdown is requested
        self._sent_queue = (0, 0, 0)  # (running, waiting, swapped) in the last stats sent

    # ---- public -------------------------------------------------------------------------

    def request_shutdown(self, timeout: float) -> None:
        """Stop admitting; finish in-flight work for up to `timeout` s, then abort the rest."""
        deadline = time.monotonic() + max(timeout, 0.0)
        if self._deadline is None:
            self._notifier.stopping(f"draining {len(self._live)} requests, "
                                    f"deadline {max(timeout, 0.0):g} s")
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def run(self) -> int:
        for thread in self._threads:
            thread.start()
        self._notifier.ready(f"serving {self._core.model_name} "
                             f"({self._core.num_gpu_blocks} KV blocks)")
        try:
            while not self._drained():
                self._run_once()
            aborted = self._finish()
            return exit_codes.DRAIN_TIMEOUT if aborted else exit_codes.OK
        except Exception as exc:  # NOTE: any failure of the core kills the engine, loudly
            log.exception("engine loop failed")
            self._send(EngineDead(reason=f"{type(exc).__name__}: {exc}",
                                  incarnation=self._incarnation))
            return exit_codes.ENGINE_DIED
        finally:
            self._stop_threads()

    # ---- busy loop ----------------------------------------------------------------------

    def _run_once(self) -> None:
        busy = self._core.has_unfinished_requests()
        deltas = self._drain_inputs(block=not busy)
        if self._core.has_unfinished_requests():
            self._maybe_hang()
            deltas += self._core.step()
            self._steps += 1
        self._emit(deltas)
        self._maybe_heartbeat()

    def _drain_inputs(self, *, block: bool) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        timeout = min(_IDLE_WAIT_S, max(self._next_heartbeat - time.monotonic(), 0.0))
        try:
            msg = self._inputs.get(timeout=timeout) if block else self._inputs.get_nowait()
            while True:
                deltas += self._handle(msg)
                msg = self._inputs.get_nowait()
        except queue.Empty:
            return deltas

    def _handle(self, msg: ToEngine) -> list[TokenDelta]:
        match msg:
            case AddRequest():
                return self._add(msg)
            case AbortRequests(request_ids=ids, index=None):
                return self._core.abort_requests(ids)
            case AbortRequests(request_ids=ids, index=index):
                return [d for rid in ids for d in self._core.abort_choice(rid, index)]
            case Shutdown(timeout=timeout):
                self.request_shutdown(timeout)
                return []
            case LoadLoraAdapter() | UnloadLoraAdapter():
                self._send(self._lora(msg))
                return []

    def _lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterResult:
        # NOTE: on the busy loop between steps: reading an adapter is short, and the step
        # must not see the slots change under it
        try:
            if isinstance(msg, LoadLoraAdapter):
                names = self._core.load_lora(msg.lora_name, msg.lora_path)
            else:
                names = self._core.unload_lora(msg.lora_name)
        except ValueError as exc:
            return LoraAdapterResult(request_id=msg.request_id, error=str(exc),
                                     incarnation=self._incarnation)
        return LoraAdapterResult(request_id=msg.request_id, adapters=names,
                                 incarnation=self._incarnation)

    def _add(self, msg: AddRequest) -> list[TokenDelta]:
        if self._deadline is not None:
            return [_error(msg.request_id, SHUTTING_DOWN)]
        try:
            self._core.add_request(msg)
        except ValueError as exc:
            return [_error(msg.request_id, str(exc))]
        self._live.add(msg.request_id)
        return []

    def _emit(self, deltas: list[TokenDelta]) -> None:
        stats = self._core.stats()
        queue = (stats.num_running, stats.num_waiting, stats.num_swapped)
        # NOTE: also sent without deltas when the queue changed (a prefill step admitted
        # requests): the gateway's admission counts what is not scheduled yet from these.
        if not deltas and queue == self._sent_queue:
            return
        self._sent_queue = queue
        for delta in deltas:
            if delta.finished:
                self._live.discard(delta.request_id)
        self._send(StepOutputs(deltas=deltas, stats=stats, incarnation=self._incarnation))

    def _maybe_heartbeat(self) -> None:
        # NOTE: sent from the busy loop on purpose: a hung step must stop the heartbeats.
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self._opts.heartbeat_interval
        self._notifier.watchdog()  # NOTE: also from the busy loop: a hung step stops it
        stats = self._core.stats()
        self._send(Heartbeat(step=self._steps, queue_depth=self._inputs.qsize() + stats.num_waiting,
                             stats=stats, incarnation=self._incarnation,
                             prefix_digest=pack_digest(self._core.cached_block_hashes())))
        if self._opts.parent_pid is not None and os.getppid() != self._opts.parent_pid:
            log.warning("parent process %d is gone; shutting down", self._opts.parent_pid)
            self.request_shutdown(0.0)

    def _maybe_hang(self) -> None:
        limit = self._opts.hang_after_steps
        if limit is not None and self._steps >= limit:
            log.warning("PAGEDSERVE_DEBUG_HANG_AFTER_STEPS=%d reached: hanging", limit)
            while True:
                time.sleep(3600)

    # ---- shutdown -----------------------------------------------------------------------

    def _drained(self) -> bool:
        if self._deadline is None:
            return False
        return not self._live or time.monotonic() >= self._deadline

    def _finish(self) -> int:
        """Abort what is left, refuse what is still queued, and tell the gateway we are done;
        returns how many requests were aborted."""
        leftover = sorted(self._live)
        deltas = self._core.abort_requests(leftover) if leftover else []
        answered = {d.request_id for d in deltas if d.finished}
        for request_id in leftover:
            if request_id not in answered:
                log.error("core returned no abort delta for %s; sending one", request_id)
                deltas.append(TokenDelta(request_id=request_id, finish_reason=FINISH_ABORT))
        self._stop_input.set()
        self._threads[0].join()
        deltas += self._drain_inputs(block=False)
        self._emit(deltas)
        reason = "shutdown" + (f" (aborted {len(leftover)} requests)" if leftover else "")
        self._send(EngineDead(reason=reason, incarnation=self._incarnation))
        return len(leftover)

    def _stop_threads(self) -> None:
        self._stop_input.set()
        self._outputs.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._sockets.close()

    # ---- IO threads ---------------------------------------------------------------------

    def _send(self, msg: FromEngine) -> None:
        self._outputs.put(msg)

    def _input_thread(self) -> None:
        # NOTE: EngineReady is repeated every heartbeat interval so that a gateway that
        # (re)starts after us, with this engine run by someone else, still finds it.
        ready, next_announce = ready_message(self._core, self._incarnation), 0.0
        while not self._stop_input.is_set():
            if time.monotonic() >= next_announce:
                self._sockets.send_handshake(ready)
                next_announce = time.monotonic() + self._opts.heartbeat_interval
            msg = self._sockets.recv_input(_IO_POLL_MS)
            if msg is not None:
                self._inputs.put(msg)

    def _output_thread(self) -> None:
        while (msg := self._outputs.get()) is not None:
            self._sockets.send_output(msg)


def _error(request_id: str, message: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, finish_reason=FINISH_ERROR, error=message)


def run_engine(config: EngineConfig, input_addr: str, output_addr: str, incarnation: str,
               options: LoopOptions | None = None,
               core_factory: Callable[[EngineConfig], Core] | None = None,
               notifier: Notifier | None = None) -> int:
    """Connect, build the core, hand-shake, run the loop; returns the exit code
    (ipc.exit_codes). `notifier` gets READY=1 once the core is built, then WATCHDOG=1 pings.

    Installs SIGTERM/SIGINT handlers when called on the main thread.
    """
    options = options or LoopOptions()
    notifier = notifier or Notifier({})
    sockets = EngineSockets(input_addr, output_addr, incarnation)
    notifier.status(f"loading {config.model or 'the bundled model'}")
    try:
        core = (core_factory or _default_core)(config)
    except Exception as exc:  # NOTE: tell the gateway why, instead of only exiting
        log.exception("engine failed to start")
        sockets.send_output(EngineDead(reason=f"startup failed: {type(exc).__name__}: {exc}",
                                       incarnation=incarnation))
        sockets.close()
        return exit_codes.ENGINE_DIED
    loop = EngineLoop(core, sockets, incarnation, options, notifier)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: loop.request_shutdown(options.shutdown_timeout))
    return loop.run()


def ready_message(core: Core, incarnation: str) -> EngineReady:
    return EngineReady(
        model=core.model_name, max_model_len=core.max_model_len, block_size=core.block_size,
        num_gpu_blocks=core.num_gpu_blocks, num_cpu_blocks=core.num_cpu_blocks,
        incarnation=incarnation, eos_token_ids=list(core.eos_token_ids),
        tokenizer=core.tokenizer_dir, max_num_seqs=core.max_num_seqs,
        max_logprobs=core.max_logprobs,
        pooling=core.pooling_info,
    )


def _default_core(config: EngineConfig) -> Core:
    from engine.core import EngineCore  # NOTE: lazy: torch and the model load only here

    # NOTE: the imports' objects (torch's and ours, about 170K) are never garbage: frozen, the
    # load's two full collections (engine/allocator.py's release_freed_heap) take about 0 ms
    # instead of 84 each, and so do the full collections while serving. This process only
    # (an in-process LLM, a test, keeps its collector as it is).
    gc.freeze()
    return EngineCore(config)
