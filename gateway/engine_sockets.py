"""The gateway's end of one pair of engine sockets, shared by EngineClient (one engine) and
EnginePool (several): bind, feed every handshake and output to callbacks, close; and the one
"ready within the startup timeout, else close and fail" rule of their `start`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ipc.messages import EngineReady, FromEngine
from ipc.transport import GatewaySockets, default_addresses

log = logging.getLogger("gateway.engine_sockets")


class EngineUnavailableError(Exception):
    """No ready engine (starting, dead, restarting or shutting down): answer 503."""


class SocketPump:
    """Binds ROUTER + PULL (fresh ipc:// addresses unless given) and, until closed, hands each
    engine handshake to `on_handshake(identity, ready)` and each output to `on_output`."""

    def __init__(self, input_addr: str | None, output_addr: str | None,
                 on_handshake: Callable[[bytes, EngineReady], Any],
                 on_output: Callable[[FromEngine], Any]) -> None:
        self._addrs = (input_addr, output_addr)
        self._on_handshake = on_handshake
        self._on_output = on_output
        self._tasks: list[asyncio.Task[None]] = []
        self.sockets: GatewaySockets | None = None

    def open(self) -> GatewaySockets:
        input_addr, output_addr = self._addrs
        if input_addr is None or output_addr is None:
            fresh = default_addresses()
            input_addr, output_addr = input_addr or fresh[0], output_addr or fresh[1]
        self.sockets = GatewaySockets(input_addr, output_addr)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._handshakes()), loop.create_task(self._outputs())]
        for task in self._tasks:
            task.add_done_callback(_log_failure)
        return self.sockets

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sockets is not None:
            self.sockets.close()

    async def _handshakes(self) -> None:
        assert self.sockets is not None
        while True:
            self._on_handshake(*await self.sockets.recv_handshake())

    async def _outputs(self) -> None:
        assert self.sockets is not None
        while True:
            self._on_output(await self.sockets.recv_output())


async def ready_within(ready: Awaitable[Any], timeout: float | None, what: str,
                       close: Callable[[], Awaitable[None]]) -> None:
    """Wait for `ready`; past `timeout` seconds (or if it fails) `close()` and raise
    EngineUnavailableError ("<what> within <timeout> s" on a timeout; None: no timeout)."""
    try:
        await asyncio.wait_for(ready, timeout)
    except (TimeoutError, EngineUnavailableError) as exc:
        await close()
        if isinstance(exc, TimeoutError):
            raise EngineUnavailableError(f"{what} within {timeout:g} s") from None
        raise


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine socket loop failed", exc_info=task.exception())
