"""`pagedserve` command line: `serve` (gateway + spawned engine), `engine` and `generate`.

`serve` runs uvicorn on uvloop; SIGTERM/SIGINT drain (see `_Drainer`), a second one forces exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence

import structlog
import uvicorn

from gateway.app import build_app
from gateway.service import Gateway, GatewaySettings
from ipc.config import add_engine_args, config_from_args

log = structlog.get_logger("pagedserve.serve")

_EXEC_MODULES = {"engine": "engine", "generate": "engine.generate"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="start the gateway and an engine process",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    group = serve.add_argument_group("gateway")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                       help="require `Authorization: Bearer <key>` on /v1 "
                            "(default: $PAGEDSERVE_API_KEY, else no auth)")
    group.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 + Retry-After beyond this many requests not yet started")
    group.add_argument("--allowed-origins", default="",
                       help="comma-separated CORS and WebSocket origins ('*' for any); "
                            "empty: same-origin WebSockets only, no CORS")
    group.add_argument("--max-body-bytes", type=int, default=GatewaySettings.max_body_bytes,
                       help="largest request body accepted (413 beyond)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may finish after SIGTERM before abort")
    group.add_argument("--log-level", default="info", help="gateway log level")
    add_engine_args(serve)
    commands.add_parser("engine", help="run one engine process (python -m engine ...)",
                        add_help=False)
    commands.add_parser("generate", help="generate offline (python -m engine.generate ...)",
                        add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _EXEC_MODULES:
        # NOTE: exec keeps the gateway's process free of torch; the engine owns its own argv.
        module = _EXEC_MODULES[args[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *args[1:]])
    ns = build_parser().parse_args(args)
    if ns.max_queued_requests is not None and ns.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be >= 1")
    configure_logging(ns.log_level)
    import uvloop

    sys.exit(uvloop.run(serve(ns)))


def configure_logging(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, format="%(message)s", stream=sys.stderr)
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


def settings_from_args(ns: argparse.Namespace) -> GatewaySettings:
    origins = tuple(o.strip() for o in ns.allowed_origins.split(",") if o.strip())
    return GatewaySettings(
        api_key=ns.api_key or None, max_queued_requests=ns.max_queued_requests,
        allowed_origins=origins, max_body_bytes=ns.max_body_bytes,
    )


async def serve(ns: argparse.Namespace) -> int:
    """Serve until drained; returns the exit status."""
    from gateway.engine_client import EngineClient, EngineUnavailableError

    client = EngineClient(config_from_args(ns))
    gateway = Gateway(client, settings_from_args(ns))
    config = uvicorn.Config(build_app(client, gateway=gateway), host=ns.host, port=ns.port,
                            lifespan="off", access_log=False, log_level=ns.log_level,
                            ws="websockets", timeout_graceful_shutdown=5)
    server = _Server(config, _Drainer(gateway, ns.shutdown_timeout))
    status = 0

    async def start_engine() -> None:
        nonlocal status
        try:
            await client.start()
            log.info("engine.ready", model=gateway.model_name)
        except EngineUnavailableError as exc:
            log.error("engine.failed", error=str(exc))
            status = 1
            server.should_exit = True

    starter = asyncio.create_task(start_engine())
    try:
        await server.serve()
    finally:
        starter.cancel()
        await asyncio.gather(starter, return_exceptions=True)
        await client.close(timeout=ns.shutdown_timeout)
    return status


class _Drainer:
    """The shutdown checklist: stop taking work (health 503, new work 503, WS told), let
    in-flight requests finish until the deadline, abort the rest, then stop the server."""

    def __init__(self, gateway: Gateway, timeout: float) -> None:
        self.gateway = gateway
        self.timeout = timeout

    async def drain(self, server: uvicorn.Server) -> None:
        gw = self.gateway
        log.info("drain.start", inflight=len(gw.generations), timeout_s=self.timeout)
        gw.begin_drain()
        if not await gw.wait_idle(self.timeout):
            log.warning("drain.abort", remaining=len(gw.generations))
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


if __name__ == "__main__":
    main()
