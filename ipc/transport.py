"""ZeroMQ sockets between gateway and engine: the gateway binds, engines connect.

Gateway: ROUTER (requests out, EngineReady handshake in) + PULL (outputs in), asyncio.
Engine: DEALER (routing id = its incarnation) + PUSH, blocking, each owned by one IO thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from ipc.codec import Encoder, decode_from_engine, decode_to_engine
from ipc.messages import EngineDead, EngineReady, FromEngine, ToEngine

log = logging.getLogger(__name__)


def runtime_dir() -> Path:
    """$PAGEDSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pagedserve, else <tmp>/pagedserve-<uid>."""
    if explicit := os.environ.get("PAGEDSERVE_RUNTIME_DIR"):
        path = Path(explicit)
    elif xdg := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(xdg) / "pagedserve"
    else:
        path = Path(tempfile.gettempdir()) / f"pagedserve-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


# NOTE: a Unix socket's path must fit sockaddr_un.sun_path (108 bytes with its NUL); the
# longest name default_addresses makes is engine-<7-digit pid>-<12 hex>-out.sock, after a "/".
IPC_PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107
_LONGEST_NAME = len("/engine-4194304-0123456789ab-out.sock")


def check_runtime_dir() -> Path:
    """The runtime directory, if the socket paths made in it fit; else a ValueError naming
    $PAGEDSERVE_RUNTIME_DIR (ZeroMQ would refuse the bind only once the gateway runs)."""
    directory = runtime_dir()
    longest = len(os.fsencode(directory)) + _LONGEST_NAME
    if longest > IPC_PATH_MAX:
        raise ValueError(f"the engine sockets' directory {directory} is too long: their paths "
                         f"would take {longest} bytes of the {IPC_PATH_MAX} a Unix socket "
                         "allows; set PAGEDSERVE_RUNTIME_DIR to a shorter directory")
    return directory


def default_addresses() -> tuple[str, str]:
    """A fresh (input, output) pair of ipc:// addresses in the runtime directory, named for
    this process; the socket files of processes that are gone are removed first."""
    directory = check_runtime_dir()
    remove_stale_sockets(directory)
    stem = directory / f"engine-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return f"ipc://{stem}-in.sock", f"ipc://{stem}-out.sock"


def remove_stale_sockets(directory: Path) -> list[Path]:
    """Delete `engine-<pid>-*.sock` files whose process no longer runs (a killed gateway's)."""
    removed = []
    for path in directory.glob("engine-*-*.sock"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and len(pid) <= 7 and not _alive(int(pid)):  # NOTE: pids < 2**22
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # NOTE: someone else's process
    return True


class GatewaySockets:
    """The gateway's end: binds both sockets. `tcp://host:*` binds a free port (see the addrs)."""

    def __init__(self, input_addr: str, output_addr: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pull = self._ctx.socket(zmq.PULL)
        # NOTE: unlimited queues: a ROUTER silently drops at its high-water mark, and the
        # gateway's admission limits, not ZeroMQ, are what bound the work in flight.
        for sock in (self._router, self._pull):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        self._router.bind(input_addr)
        self._pull.bind(output_addr)
        self.input_addr: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_addr: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = Encoder()

    def send(self, identity: bytes, msg: ToEngine) -> None:
        """Queue a message to one engine; never blocks (an unknown identity drops it)."""
        frames = [identity, self._encoder.encode(msg)]
        self._router.send_multipart(frames, flags=zmq.NOBLOCK).add_done_callback(_log_failure)

    async def recv_handshake(self) -> tuple[bytes, EngineReady]:
        """Next EngineReady from any engine's DEALER, with its routing identity."""
        while True:
            identity, payload = await self._router.recv_multipart()
            msg = _decode_or_none(payload)
            if isinstance(msg, EngineReady):
                return identity, msg
            log.warning("unexpected message on the handshake socket: %r", msg)

    async def recv_output(self) -> FromEngine:
        while True:
            msg = _decode_or_none(await self._pull.recv())
            if msg is not None:
                return msg

    def close(self) -> None:
        self._router.close()
        self._pull.close()
        self._ctx.term()
        for addr in (self.input_addr, self.output_addr):
            _unlink_ipc(addr)


class EngineSockets:
    """The engine's end. Each socket is used by one thread only (ZeroMQ sockets are not
    thread-safe): the DEALER by the main thread for the handshake, then by the input thread."""

    def __init__(self, input_addr: str, output_addr: str, incarnation: str) -> None:
        self._ctx = zmq.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._push = self._ctx.socket(zmq.PUSH)
        self._dealer.setsockopt(zmq.ROUTING_ID, incarnation.encode())
        for sock in (self._dealer, self._push):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._dealer.connect(input_addr)
        self._push.connect(output_addr)
        self._handshake_encoder = Encoder()
        self._output_encoder = Encoder()

    def send_handshake(self, msg: EngineReady | EngineDead) -> None:
        # NOTE: EngineReady goes over the DEALER so that the gateway's ROUTER has learnt our
        # routing id by the time it reads the handshake and starts sending requests.
        self._dealer.send(self._handshake_encoder.encode(msg))

    def recv_input(self, timeout_ms: int) -> ToEngine | None:
        """Next message for the engine, or None after timeout_ms (or on a bad frame)."""
        if not self._dealer.poll(timeout_ms, zmq.POLLIN):
            return None
        payload = self._dealer.recv()
        try:
            return decode_to_engine(payload)
        except msgspec.DecodeError as exc:
            log.error("dropping an undecodable frame from the gateway: %s", exc)
            return None

    def send_output(self, msg: FromEngine) -> None:
        self._push.send(self._output_encoder.encode_into(msg))

    def close(self, linger_ms: int = 2000) -> None:
        """Close both sockets, waiting up to linger_ms for queued outputs to leave."""
        self._dealer.close(linger=0)
        self._push.close(linger=linger_ms)
        self._ctx.term()


def _decode_or_none(payload: bytes) -> FromEngine | None:
    try:
        return decode_from_engine(payload)
    except msgspec.DecodeError as exc:
        log.error("dropping an undecodable frame from an engine: %s", exc)
        return None


def _log_failure(future: asyncio.Future[object]) -> None:
    if future.cancelled():
        return
    if (exc := future.exception()) is not None:
        log.error("failed to send to an engine: %s", exc)


def _unlink_ipc(addr: str) -> None:
    if addr.startswith("ipc://"):
        Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)
