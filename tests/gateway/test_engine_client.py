"""EngineClient against a real engine subprocess running a fake core (tests/ipc/fake_engine.py).

Covers streaming, aborts, engine death (kill -9, EngineDead, hung loop) and restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import uvloop

from gateway.engine_client import EngineClient, EngineUnavailableError, RequestStream
from ipc.config import EngineConfig
from ipc.messages import AddRequest, EngineReady, Heartbeat, StepOutputs, TokenDelta
from ipc.sampling import SamplingParams
from ipc.transport import EngineSockets

pytestmark = pytest.mark.timeout(60)
FAKE_ENGINE = [sys.executable, str(Path(__file__).parents[1] / "ipc" / "fake_engine.py")]


def _client(**kwargs: object) -> EngineClient:
    opts: dict[str, object] = dict(heartbeat_timeout=3.0, heartbeat_interval=0.2,
                                   startup_timeout=30.0, engine_command=FAKE_ENGINE)
    opts.update(kwargs)
    return EngineClient(EngineConfig(), **opts)  # type: ignore[arg-type]


def _add(rid: str, max_tokens: int = 3, prompt: list[int] | None = None) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=[1, 2] if prompt is None else prompt,
                      sampling=SamplingParams(max_tokens=max_tokens))


async def _collect(stream: RequestStream, timeout: float = 10.0) -> list[TokenDelta]:
    async def run() -> list[TokenDelta]:
        return [d async for d in stream]

    return await asyncio.wait_for(run(), timeout)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_stream_to_completion_and_clean_close() -> None:
    client = _client()
    await client.start()
    try:
        assert client.ready and client.info is not None and client.info.model == "fake"
        streams = [client.submit(_add(f"r{i}", max_tokens=i + 1)) for i in range(3)]
        assert client.num_inflight == 3
        for i, stream in enumerate(streams):
            deltas = await _collect(stream)
            assert [d.finish_reason for d in deltas] == [None] * i + ["length"]
            assert stream.finished
        assert client.num_inflight == 0
        assert client.stats is not None
        client.submit(_add("dup", max_tokens=20))
        with pytest.raises(ValueError, match="already in flight"):
            client.submit(_add("dup"))
    finally:
        pid = client.pid
        await client.close(timeout=2)
    assert pid is not None and _gone(pid)
    assert client._proc is not None and client._proc.returncode == 0
    assert not client.ready
    with pytest.raises(EngineUnavailableError):
        client.submit(_add("late"))


async def test_abort_and_aclose() -> None:
    client = _client()
    await client.start()
    try:
        stream = client.submit(_add("long", max_tokens=100_000))
        first = await anext(stream)
        assert first.new_token_ids and not first.finished
        client.abort("long")
        client.abort("long")
        client.abort("never-submitted")
        rest = await _collect(stream)
        assert rest[-1] == TokenDelta(request_id="long", finish_reason="abort")
        assert sum(d.finished for d in rest) == 1

        closed = client.submit(_add("closed", max_tokens=100_000))
        await anext(closed)
        await closed.aclose()
        assert client.num_inflight == 0
        assert [d async for d in closed] == []
        for _ in range(100):  # the engine frees it within a step or two
            if client.stats is not None and client.stats.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert client.stats is not None and client.stats.num_running == 0

        bad = await _collect(client.submit(_add("bad", prompt=[])))
        assert bad == [TokenDelta(request_id="bad", finish_reason="error",
                                  error="prompt must not be empty")]
    finally:
        await client.close(timeout=2)


async def test_kill_9_mid_stream_fails_streams_and_restarts() -> None:
    client = _client()
    await client.start()
    try:
        old_pid, old_inc = client.pid, client.info.incarnation  # type: ignore[union-attr]
        streams = [client.submit(_add(f"r{i}", max_tokens=100_000)) for i in range(3)]
        for stream in streams:
            await anext(stream)
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        for stream in streams:
            deltas = await _collect(stream)
            assert deltas[-1].finish_reason == "error"
            assert deltas[-1].error is not None and deltas[-1].error.startswith("engine died:")
        assert not client.ready and client.num_inflight == 0
        with pytest.raises(EngineUnavailableError):
            client.submit(_add("while-down"))

        await client.wait_ready(timeout=20)
        assert client.pid != old_pid and client.info is not None
        assert client.info.incarnation != old_inc and client.restarts == 1
        deltas = await _collect(client.submit(_add("after", max_tokens=2)))
        assert deltas[-1].finish_reason == "length"
    finally:
        await client.close(timeout=2)


async def test_hung_engine_is_detected_by_heartbeat_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEDSERVE_DEBUG_HANG_AFTER_STEPS", "5")
    client = _client(heartbeat_timeout=1.0, restart=False)
    await client.start()
    try:
        pid = client.pid
        deltas = await _collect(client.submit(_add("r", max_tokens=100_000)))
        assert len(deltas) == 6  # five tokens, then the failure
        assert deltas[-1].finish_reason == "error"
        assert deltas[-1].error is not None and "no heartbeat" in deltas[-1].error
        assert not client.ready
        for _ in range(100):  # the hung process is killed
            if pid is not None and _gone(pid):
                break
            await asyncio.sleep(0.05)
        assert pid is not None and _gone(pid)
    finally:
        await client.close(timeout=1)


async def test_exception_in_step_fails_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_AT_STEP", "3")
    client = _client(restart=False)
    await client.start()
    try:
        deltas = await _collect(client.submit(_add("r", max_tokens=100)))
        assert deltas[-1].error is not None and "kernel exploded" in deltas[-1].error
        assert not client.ready and client.last_error is not None
    finally:
        await client.close(timeout=1)


async def test_engine_that_dies_at_startup_fails_start() -> None:
    client = _client(engine_command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(EngineUnavailableError, match="code 3"):
        await client.start()
    assert not client.ready


async def test_external_engine_and_stale_incarnations_are_dropped() -> None:
    client = _client(spawn=False, input_addr="tcp://127.0.0.1:*",
                     output_addr="tcp://127.0.0.1:*")
    ready = EngineReady(model="ext", max_model_len=8, block_size=4, num_gpu_blocks=2,
                        incarnation="new")
    start = asyncio.create_task(client.start())
    await asyncio.sleep(0.1)
    engine = EngineSockets(client.input_addr, client.output_addr, "new")
    try:
        engine.send_handshake(ready)
        await asyncio.wait_for(start, 5)
        assert client.ready and client.info is not None and client.info.model == "ext"
        stream = client.submit(_add("r"))
        assert await asyncio.to_thread(engine.recv_input, 5000) == _add("r")
        engine.send_output(StepOutputs(deltas=[TokenDelta(request_id="r", new_token_ids=[9],
                                                          finish_reason="stop")],
                                       incarnation="stale"))
        engine.send_output(Heartbeat(step=1, queue_depth=0, incarnation="new"))
        engine.send_output(StepOutputs(deltas=[TokenDelta(request_id="r", new_token_ids=[1],
                                                          finish_reason="length")],
                                       incarnation="new"))
        assert await _collect(stream) == [
            TokenDelta(request_id="r", new_token_ids=[1], finish_reason="length")]
    finally:
        engine.close(linger_ms=0)
        await client.close(timeout=0)


def test_works_under_uvloop() -> None:
    async def scenario() -> None:
        client = _client()
        await client.start()
        try:
            deltas = await _collect(client.submit(_add("u", max_tokens=2)))
            assert deltas[-1].finish_reason == "length"
        finally:
            await client.close(timeout=2)

    uvloop.run(scenario())


_ORPHAN_PARENT = """
import asyncio, sys
from gateway.engine_client import EngineClient
from ipc.config import EngineConfig

async def main():
    client = EngineClient(EngineConfig(), engine_command=sys.argv[1:], heartbeat_interval=0.2)
    await client.start()
    print(client.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # NOTE: a zombie waiting for an adoptive parent to reap it


async def test_engine_exits_when_the_gateway_is_killed() -> None:
    root = str(Path(__file__).parents[2])
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ORPHAN_PARENT, *FAKE_ENGINE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": root})
    assert parent.stdout is not None
    engine_pid = int(await asyncio.wait_for(parent.stdout.readline(), 20))
    parent.kill()
    await parent.wait()
    for _ in range(200):
        if _exited(engine_pid):
            break
        await asyncio.sleep(0.05)
    assert _exited(engine_pid)


async def test_a_restarted_gateway_finds_a_running_external_engine() -> None:
    first = _client(spawn=False, input_addr="tcp://127.0.0.1:*", output_addr="tcp://127.0.0.1:*")
    starting = asyncio.create_task(first.start())
    await asyncio.sleep(0.05)
    addrs = (first.input_addr, first.output_addr)
    engine = await asyncio.create_subprocess_exec(
        *FAKE_ENGINE, "--input-addr", addrs[0], "--output-addr", addrs[1],
        "--heartbeat-interval", "0.2")
    try:
        await asyncio.wait_for(starting, 20)
        assert (await _collect(first.submit(_add("a"))))[-1].finish_reason == "length"
        await first.close(timeout=0)  # spawn=False: the engine is not ours to stop
        assert engine.returncode is None

        second = _client(spawn=False, input_addr=addrs[0], output_addr=addrs[1])
        await second.start()
        try:
            assert second.info is not None and second.info.incarnation == first.info.incarnation
            assert (await _collect(second.submit(_add("b"))))[-1].finish_reason == "length"
        finally:
            await second.close(timeout=0)
    finally:
        engine.terminate()
        assert await asyncio.wait_for(engine.wait(), 10) == 0
