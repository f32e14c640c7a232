"""`python -m engine`: one engine process, connected to a gateway's sockets (what it spawns)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Callable

from engine.process import Core, LoopOptions, run_engine
from ipc import exit_codes
from ipc.config import EngineConfig, add_engine_args, config_from_args
from ipc.sd_notify import Notifier

HANG_ENV = "PAGEDSERVE_DEBUG_HANG_AFTER_STEPS"  # test-only: see LoopOptions.hang_after_steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    add_engine_args(parser)
    group = parser.add_argument_group("process")
    group.add_argument("--input-addr", required=True,
                       help="the gateway's ROUTER address (ipc://... or tcp://host:port)")
    group.add_argument("--output-addr", required=True,
                       help="the gateway's PULL address (ipc://... or tcp://host:port)")
    group.add_argument("--incarnation", default=None,
                       help="id stamped on every message (default: a fresh random id)")
    group.add_argument("--shutdown-timeout", type=float, default=LoopOptions.shutdown_timeout,
                       help="seconds to finish in-flight requests after SIGTERM "
                            f"(default: {LoopOptions.shutdown_timeout})")
    group.add_argument("--heartbeat-interval", type=float,
                       default=LoopOptions.heartbeat_interval,
                       help=f"seconds between heartbeats (default: "
                            f"{LoopOptions.heartbeat_interval})")
    group.add_argument("--parent-pid", type=int, default=None,
                       help="shut down when this process is no longer our parent")
    return parser


# NOTE: the `gguf` package's import pulls its vocabulary writers' optional backend,
# mistral_common, when installed (vLLM installs it; here the test extra does), and with it
# pydantic, requests, PIL, tiktoken and pycountry: 29 MiB resident and 0.2 s that an engine
# process never uses (it reads GGUF files only and never sees text). Marked absent in this
# process only (an ImportError for gguf, which it handles); `LLM` in process is left alone.
NOT_NEEDED = ("mistral_common",)


def skip_unneeded_imports() -> None:
    for name in NOT_NEEDED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None,
         core_factory: Callable[[EngineConfig], Core] | None = None) -> int:
    skip_unneeded_imports()
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(ns)
    except ValueError as exc:
        parser.exit(exit_codes.CONFIG_ERROR, f"engine: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    hang = os.environ.get(HANG_ENV)
    options = LoopOptions(
        heartbeat_interval=ns.heartbeat_interval,
        shutdown_timeout=ns.shutdown_timeout,
        parent_pid=ns.parent_pid,
        hang_after_steps=int(hang) if hang else None,
    )
    incarnation = ns.incarnation or uuid.uuid4().hex
    # NOTE: only a process run directly by systemd (pagedserve-engine@.service) notifies; the
    # gateway strips NOTIFY_SOCKET from the engines it spawns.
    return run_engine(config, ns.input_addr, ns.output_addr, incarnation, options,
                      core_factory, Notifier())


if __name__ == "__main__":
    sys.exit(main())
