"""The engine process loop over real sockets, driving a fake core (a test double of EngineCore)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from core_protocol import core_protocol_gaps
from fake_engine import FakeCore

from engine.process import SHUTTING_DOWN, LoopOptions, run_engine
from ipc import exit_codes
from ipc.config import EngineConfig
from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    FromEngine,
    Heartbeat,
    Shutdown,
    StepOutputs,
    TokenDelta,
)
from ipc.sampling import SamplingParams
from ipc.transport import GatewaySockets

pytestmark = pytest.mark.timeout(30)
INC = "inc-test"


class Harness:
    """The gateway's sockets plus an engine loop on a thread."""

    def __init__(self, core: FakeCore | None, options: LoopOptions | None = None) -> None:
        self.gw = GatewaySockets("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.core = core
        self.exit_code: int | None = None
        self.identity = b""
        self._thread = threading.Thread(target=self._run, args=(options,), daemon=True)
        self._thread.start()

    def _run(self, options: LoopOptions | None) -> None:
        def factory(_: EngineConfig) -> FakeCore:
            if self.core is None:
                raise OSError("no weights here")
            return self.core

        self.exit_code = run_engine(EngineConfig(), self.gw.input_addr, self.gw.output_addr, INC,
                                    options or LoopOptions(heartbeat_interval=0.1), factory)

    async def handshake(self) -> EngineReady:
        self.identity, ready = await asyncio.wait_for(self.gw.recv_handshake(), 5)
        return ready

    def add(self, rid: str, prompt: list[int] | None = None, max_tokens: int = 3) -> None:
        self.gw.send(self.identity, AddRequest(
            request_id=rid, prompt_token_ids=[1, 2] if prompt is None else prompt,
            sampling=SamplingParams(max_tokens=max_tokens)))

    async def until(self, done: type, timeout: float = 5.0) -> tuple[list[TokenDelta], FromEngine]:
        """Collect deltas until a message of type `done` (or a terminal for all in `done`)."""
        deltas: list[TokenDelta] = []
        while True:
            msg = await asyncio.wait_for(self.gw.recv_output(), timeout)
            assert msg.incarnation == INC
            if isinstance(msg, StepOutputs):
                deltas += msg.deltas
            if isinstance(msg, done):
                return deltas, msg

    async def terminals(self, n: int) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        while sum(d.finished for d in deltas) < n:
            deltas += (await self.until(StepOutputs))[0]
        return deltas

    async def close(self) -> int | None:
        if self._thread.is_alive():
            self.gw.send(self.identity, Shutdown(timeout=0))
        await asyncio.to_thread(self._thread.join, 10)
        self.gw.close()
        return self.exit_code


def _by_request(deltas: list[TokenDelta]) -> dict[str, list[TokenDelta]]:
    out: dict[str, list[TokenDelta]] = {}
    for d in deltas:
        out.setdefault(d.request_id, []).append(d)
    return out


async def test_handshake_tokens_and_heartbeats() -> None:
    h = Harness(FakeCore())
    try:
        ready = await h.handshake()
        assert (ready.model, ready.incarnation) == ("fake", INC)
        assert ready.tokenizer == "/nonexistent/tokenizer"
        assert h.identity == INC.encode()
        h.add("a", max_tokens=3)
        h.add("b", max_tokens=1)
        per = _by_request(await h.terminals(2))
        assert [len(d.new_token_ids) for d in per["a"]] == [1, 1, 1]
        assert [d.finish_reason for d in per["a"]] == [None, None, "length"]
        assert [d.finish_reason for d in per["b"]] == ["length"]
        _, beat = await h.until(Heartbeat)
        assert beat.step >= 3 and beat.stats is not None and beat.queue_depth == 0
    finally:
        assert await h.close() == 0


def test_the_fake_core_has_every_member_of_the_core_protocol() -> None:
    assert core_protocol_gaps(FakeCore()) == []


async def test_handshake_and_heartbeat_carry_the_cores_own_values() -> None:
    """The loop reads the core's typed members as they are (no probes with defaults)."""
    core = FakeCore()
    core.num_cpu_blocks, core.max_num_seqs, core.max_logprobs = 3, 5, 7
    hashes = [bytes(range(32)), bytes(range(1, 33))]
    core.cached_block_hashes = lambda: hashes
    h = Harness(core)
    try:
        ready = await h.handshake()
        assert (ready.num_cpu_blocks, ready.max_num_seqs, ready.max_logprobs) == (3, 5, 7)
        _, beat = await h.until(Heartbeat)
        # NOTE: ipc.prefix_hash.DIGEST_BYTES (8) of each hash, in order
        assert beat.prefix_digest == bytes(range(8)) + bytes(range(1, 9))
    finally:
        assert await h.close() == 0


async def test_bad_input_gets_a_terminal_error_and_the_engine_goes_on() -> None:
    h = Harness(FakeCore())
    try:
        await h.handshake()
        h.add("empty", prompt=[])
        h.add("long", prompt=list(range(100)))
        h.add("ok", max_tokens=1)
        per = _by_request(await h.terminals(3))
        assert per["empty"] == [TokenDelta(request_id="empty", finish_reason="error",
                                           error="prompt must not be empty")]
        assert per["long"][0].error == "prompt is too long"
        assert per["ok"][-1].finish_reason == "length"
    finally:
        assert await h.close() == 0


async def test_abort_is_idempotent_and_takes_effect_within_one_step() -> None:
    core = FakeCore(step_delay=0.01)
    h = Harness(core)
    try:
        await h.handshake()
        h.add("long", max_tokens=10_000)
        await h.until(StepOutputs)
        h.gw.send(h.identity, AbortRequests(request_ids=["long", "long", "unknown"]))
        h.gw.send(h.identity, AbortRequests(request_ids=["long"]))
        deltas = await h.terminals(1)
        assert deltas[-1] == TokenDelta(request_id="long", finish_reason="abort")
        h.add("after", max_tokens=2)  # the loop is still healthy, and no second abort came
        per = _by_request(await h.terminals(1))
        assert set(per) == {"after"}
        assert not core.has_unfinished_requests()
    finally:
        assert await h.close() == 0


async def test_shutdown_drains_in_flight_and_refuses_new_work() -> None:
    h = Harness(FakeCore(step_delay=0.01))
    try:
        await h.handshake()
        h.add("a", max_tokens=5)
        h.gw.send(h.identity, Shutdown(timeout=5.0))
        h.add("late")
        deltas, dead = await h.until(EngineDead)
        per = _by_request(deltas)
        assert [d.finish_reason for d in per["a"]][-1] == "length"
        assert per["late"] == [TokenDelta(request_id="late", finish_reason="error",
                                          error=SHUTTING_DOWN)]
        assert dead.reason == "shutdown"
    finally:
        assert await h.close() == 0


async def test_shutdown_deadline_aborts_the_rest() -> None:
    h = Harness(FakeCore(step_delay=0.01))
    try:
        await h.handshake()
        h.add("forever", max_tokens=10_000)
        await h.until(StepOutputs)
        h.gw.send(h.identity, Shutdown(timeout=0.2))
        deltas, dead = await h.until(EngineDead)
        terminal = [d for d in deltas if d.finished]
        assert terminal == [TokenDelta(request_id="forever", finish_reason="abort")]
        assert "aborted 1" in dead.reason
    finally:
        assert await h.close() == exit_codes.DRAIN_TIMEOUT


async def test_exception_in_step_sends_engine_dead_and_exits_non_zero() -> None:
    h = Harness(FakeCore(fail_at_step=2))
    await h.handshake()
    h.add("a", max_tokens=5)
    _, dead = await h.until(EngineDead)
    assert "kernel exploded" in dead.reason
    assert await h.close() == exit_codes.ENGINE_DIED


async def test_startup_failure_is_reported() -> None:
    h = Harness(None)
    msg = await asyncio.wait_for(h.gw.recv_output(), 5)
    assert isinstance(msg, EngineDead) and "no weights here" in msg.reason
    assert await h.close() == exit_codes.ENGINE_DIED
