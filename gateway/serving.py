"""`pagedserve serve` once its engines are spawned: the gateway's state, the HTTP server, the
drain on SIGTERM and the systemd watchdog. Imported by gateway/cli.py after the spawn, so that
this web stack's imports overlap the engines' own start.

SIGTERM/SIGINT drain (see `_Drainer`), a second one forces exit. Exit codes: ipc.exit_codes;
under systemd it speaks sd_notify (READY, STATUS, WATCHDOG, STOPPING).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import traceback
from collections.abc import Iterator

import structlog
import uvicorn

from gateway.app import build_app
from gateway.engine_client import EngineUnavailableError
from gateway.model_registry import Engines, ModelRegistry
from gateway.read_timeouts import timed_protocol
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from ipc import exit_codes
from ipc.sd_notify import Notifier

log = structlog.get_logger("pagedserve.serve")


def configure_logging(level: str) -> None:
    """structlog's JSON lines on stderr (gateway/cli.py set up `logging` before the spawn)."""
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


async def serve(ns: argparse.Namespace, settings: GatewaySettings,
                client: Engines | ModelRegistry, starting: asyncio.Future[None]) -> int:
    """Serve until drained, `client` being started by `starting`; returns the exit status
    (ipc.exit_codes)."""
    configure_logging(ns.log_level)
    gateway = Gateway(client, settings)
    notifier = Notifier()
    drainer = _Drainer(gateway, ns.shutdown_timeout, notifier)
    server = _Server(_uvicorn_config(ns, gateway), drainer)
    status = exit_codes.OK

    async def start_engine() -> None:
        nonlocal status
        notifier.status("waiting for the engine" if ns.attach_engine else "starting the engine")
        try:
            await starting
            log.info("engine.ready", model=gateway.model_name)
        except EngineUnavailableError as exc:
            log.error("engine.failed", error=str(exc))
            status = exit_codes.ENGINE_DIED
            server.should_exit = True
            return
        except Exception as exc:
            # NOTE: never a gateway left listening with no engine coming: exit, with the cause
            log.error("engine.start_failed", error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
            status = exit_codes.FAILURE
            server.should_exit = True
            return
        while not server.started:  # NOTE: READY=1 means "send traffic": the port must be open
            await asyncio.sleep(0.05)
        notifier.ready(_status_line(gateway))

    tasks = [asyncio.create_task(start_engine()),
             asyncio.create_task(_supervise(gateway, notifier))]
    try:
        await server.serve()
    except SystemExit:
        # NOTE: uvicorn exits 3 when it cannot listen, and 3 means "engine died" here.
        log.error("listen.failed", host=ns.host, port=ns.port)
        status = exit_codes.LISTEN_FAILED
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        notifier.stopping("closing the engine")
        await client.close(timeout=ns.shutdown_timeout)
        if gateway.tracer is not None:
            gateway.tracer.shutdown()  # exports the spans still batched
        notifier.close()
    if status == exit_codes.OK and drainer.timed_out:
        status = exit_codes.DRAIN_TIMEOUT
    return status


def _uvicorn_config(ns: argparse.Namespace, gateway: Gateway) -> uvicorn.Config:
    return uvicorn.Config(build_app(gateway.client, gateway=gateway), host=ns.host,
                          port=ns.port, lifespan="off", access_log=False,
                          log_level=ns.log_level, ws="websockets-sansio",
                          timeout_graceful_shutdown=5,
                          http=timed_protocol(ns.header_timeout, ns.body_timeout),
                          ws_max_size=ns.max_body_bytes)


def _status_line(gateway: Gateway) -> str:
    if gateway.draining:
        return f"draining: {len(gateway.generations)} requests in flight"
    if gateway.ready:
        return f"serving {gateway.model_name}: {len(gateway.generations)} requests in flight"
    error = getattr(gateway.client, "last_error", None)
    return "engine unavailable" + (f" ({error}); waiting for it to restart" if error else "")


async def _supervise(gateway: Gateway, notifier: Notifier) -> None:
    """WATCHDOG=1 from the event loop (a blocked loop stops the pings, and systemd restarts
    us) and a STATUS= line whenever the engine's state changes."""
    if not notifier.enabled:
        return
    period = min(notifier.watchdog_interval or 1.0, 1.0)
    last = ""
    while True:
        if notifier.watchdog_interval is not None:
            notifier.watchdog()
        line = _status_line(gateway)
        if line != last and gateway.client.info is not None:
            notifier.status(line)
            last = line
        await asyncio.sleep(period)


class _Drainer:
    """The shutdown checklist: stop taking work (health 503, new work 503, WS told), let
    in-flight requests finish until the deadline, abort the rest, then stop the server."""

    def __init__(self, gateway: Gateway, timeout: float, notifier: Notifier) -> None:
        self.gateway = gateway
        self.timeout = timeout
        self.notifier = notifier
        self.timed_out = False  # in-flight requests had to be aborted at the deadline

    async def drain(self, server: uvicorn.Server) -> None:
        gw = self.gateway
        log.info("drain.start", inflight=len(gw.generations), timeout_s=self.timeout)
        self.notifier.stopping(f"draining {len(gw.generations)} requests, "
                               f"deadline {self.timeout:g} s")
        gw.begin_drain()
        if not await gw.wait_idle(self.timeout):
            log.warning("drain.abort", remaining=len(gw.generations))
            self.timed_out = True
            gw.abort_all()
            await gw.wait_idle(5.0)
        server.should_exit = True


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drainer: _Drainer) -> None:
        super().__init__(config)
        self._drainer = drainer
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn's own handler stops at once and re-raises the signal; we drain first.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drainer.drain(self))
        else:
            self.should_exit = self.force_exit = True
