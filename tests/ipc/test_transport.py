"""ZeroMQ transport: handshake over DEALER/ROUTER, requests out, outputs in (ipc:// and tcp://)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from ipc import transport
from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineReady,
    Heartbeat,
    StepOutputs,
    TokenDelta,
)
from ipc.sampling import SamplingParams

pytestmark = pytest.mark.timeout(30)


def _ready(incarnation: str) -> EngineReady:
    return EngineReady(model="m", max_model_len=64, block_size=16, num_gpu_blocks=8,
                       incarnation=incarnation)


async def _round_trip(gw: transport.GatewaySockets, incarnation: str) -> None:
    eng = transport.EngineSockets(gw.input_addr, gw.output_addr, incarnation)
    try:
        eng.send_handshake(_ready(incarnation))
        identity, ready = await asyncio.wait_for(gw.recv_handshake(), 5)
        assert identity == incarnation.encode()
        assert ready == _ready(incarnation)

        add = AddRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams())
        gw.send(identity, add)
        gw.send(identity, AbortRequests(request_ids=["r"]))
        got = [await asyncio.to_thread(eng.recv_input, 5000) for _ in range(2)]
        assert got == [add, AbortRequests(request_ids=["r"])]
        assert eng.recv_input(10) is None

        out = StepOutputs(deltas=[TokenDelta(request_id="r", new_token_ids=[3])],
                          incarnation=incarnation)
        eng.send_output(out)
        eng.send_output(Heartbeat(step=1, queue_depth=0, incarnation=incarnation))
        assert await asyncio.wait_for(gw.recv_output(), 5) == out
        assert isinstance(await asyncio.wait_for(gw.recv_output(), 5), Heartbeat)
    finally:
        eng.close(linger_ms=0)


async def test_round_trip_over_ipc(short_tmp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = short_tmp_dir
    monkeypatch.setenv("PAGEDSERVE_RUNTIME_DIR", str(tmp_path))
    in_addr, out_addr = transport.default_addresses()
    assert in_addr.startswith(f"ipc://{tmp_path}/") and out_addr != in_addr
    gw = transport.GatewaySockets(in_addr, out_addr)
    try:
        await _round_trip(gw, "inc-1")
    finally:
        gw.close()
    assert list(tmp_path.iterdir()) == []  # socket files removed


async def test_round_trip_over_tcp_on_a_free_port() -> None:
    gw = transport.GatewaySockets("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        assert gw.input_addr.startswith("tcp://127.0.0.1:")
        assert not gw.input_addr.endswith(":*")
        await _round_trip(gw, "inc-1")
    finally:
        gw.close()


async def test_a_restarted_engine_gets_its_own_identity() -> None:
    gw = transport.GatewaySockets("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        await _round_trip(gw, "inc-1")
        await _round_trip(gw, "inc-2")
    finally:
        gw.close()


async def test_sending_to_an_unknown_engine_does_not_block_or_raise() -> None:
    gw = transport.GatewaySockets("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        gw.send(b"nobody", AbortRequests(request_ids=["x"]))
        await asyncio.sleep(0)
    finally:
        gw.close()


def test_runtime_dir_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert transport.runtime_dir() == tmp_path / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_RUNTIME_DIR", str(tmp_path / "x"))
    assert transport.runtime_dir() == tmp_path / "x"
    assert (tmp_path / "x").is_dir()


def test_socket_files_of_a_gone_gateway_are_removed(short_tmp_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = short_tmp_dir
    monkeypatch.setenv("PAGEDSERVE_RUNTIME_DIR", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = [tmp_path / f"engine-{gone}-0123456789ab-{end}.sock" for end in ("in", "out")]
    live = tmp_path / f"engine-{os.getpid()}-ba9876543210-in.sock"
    other = tmp_path / "notes.sock"
    for path in (*stale, live, other):
        path.touch()
    in_addr, _ = transport.default_addresses()
    assert f"/engine-{os.getpid()}-" in in_addr
    assert sorted(tmp_path.iterdir()) == sorted([live, other])


def _dir_of_length(base: Path, length: int) -> Path:
    path = base / ("d" * (length - len(os.fsencode(base)) - 1))
    path.mkdir()
    assert len(os.fsencode(path)) == length
    return path


async def test_the_runtime_dir_is_refused_where_its_socket_paths_would_not_fit(
        short_tmp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The longest path default_addresses makes still binds (ZeroMQ is the judge) in the
    longest directory the check accepts; one byte more is a ValueError naming the variable."""
    fits = _dir_of_length(short_tmp_dir, transport.IPC_PATH_MAX - transport._LONGEST_NAME)
    monkeypatch.setenv("PAGEDSERVE_RUNTIME_DIR", str(fits))
    assert transport.check_runtime_dir() == fits
    longest = f"ipc://{fits}/engine-4194304-0123456789ab-out.sock"
    transport.GatewaySockets(longest.replace("out.sock", "in.sock"), longest).close()
    over = _dir_of_length(short_tmp_dir, transport.IPC_PATH_MAX - transport._LONGEST_NAME + 1)
    monkeypatch.setenv("PAGEDSERVE_RUNTIME_DIR", str(over))
    with pytest.raises(ValueError, match="set PAGEDSERVE_RUNTIME_DIR to a shorter"):
        transport.default_addresses()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(zmq.ZMQError):  # NOTE: what the check saves the gateway from
            sock.bind(f"ipc://{over}/engine-4194304-0123456789ab-out.sock")
    finally:
        sock.close(linger=0)
        ctx.term()
