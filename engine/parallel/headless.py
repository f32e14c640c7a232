"""`pagedserve serve --headless` (`python -m engine.parallel.headless`): a node that runs only
its tensor-parallel ranks, no gateway and no scheduler. They join node 0's engine at
--master-addr:--master-port, take their records from it, and exit when it stops or dies.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from engine.devices import resolve_device, resolve_dtype
from engine.parallel.driver import checkpoint
from engine.parallel.group import Topology
from engine.parallel.worker import WorkerArgs, start_workers
from ipc import exit_codes
from ipc.config import add_engine_args, config_from_args
from ipc.model_source import resolve_model

log = logging.getLogger("engine.parallel.headless")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve serve --headless", description=__doc__)
    add_engine_args(parser)
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(ns)
        config.check_headless()
    except ValueError as exc:
        parser.exit(exit_codes.CONFIG_ERROR, f"headless: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s headless[%(process)d] %(levelname)s %(message)s")
    device = resolve_device(config.device)
    cfg, files = checkpoint(resolve_model(config.model))
    topology = Topology.from_config(config)
    args = WorkerArgs(topology, cfg, files, resolve_dtype(config.dtype, device), device.type,
                      config.num_threads)
    procs = start_workers(args, topology.local_ranks)
    log.info("node %d of %d: ranks %s, meeting at %s", config.node_rank, config.nnodes,
             list(topology.local_ranks), topology.init_method)

    def stop(signum: int, frame: FrameType | None) -> None:
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    log.info("ranks exited with %s", codes)
    return exit_codes.OK if all(c == 0 for c in codes) else exit_codes.ENGINE_DIED


if __name__ == "__main__":
    sys.exit(main())
