"""A tensor-parallel worker process (every rank but 0): loads its shard, builds the same
ModelRunner as rank 0 over its own KV caches, and runs every plan rank 0 sends on the channel.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from pathlib import Path

import torch
import torch.distributed as dist

from engine.allocator import tune_malloc
from engine.models.config import ModelConfig
from engine.parallel import records
from engine.parallel.group import Channel, Topology, join
from engine.parallel.layers import TensorParallelLlama, load_shard, shard_plan

log = logging.getLogger("engine.parallel.worker")


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """What every worker of one engine shares (its rank is passed beside)."""

    topology: Topology
    cfg: ModelConfig
    files: list[Path]
    dtype: torch.dtype
    device: str  # the device type: cuda (one device per local rank) or cpu
    num_threads: int | None


def start_workers(args: WorkerArgs, ranks: range) -> list[mp.process.BaseProcess]:
    """Spawn one process per rank (spawn, not fork: CUDA and gloo do not survive a fork)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        proc = ctx.Process(target=worker_main, args=(args, rank), name=f"tp-worker{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def build_shard(cfg: ModelConfig, rank: int, size: int, files: list[Path], dtype: torch.dtype,
                device: torch.device) -> TensorParallelLlama:
    with torch.device("meta"):
        model = TensorParallelLlama(cfg, shard_plan(cfg, rank, size))
    model = model.to(dtype).to_empty(device=device)
    load_shard(model, files)
    return model.eval().requires_grad_(False)


def worker_main(args: WorkerArgs, rank: int) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-worker{rank}[%(process)d] %(message)s")
    torch.set_num_threads(args.num_threads or 1)
    device = args.topology.device(rank, args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = join(args.topology, rank, device)
    model = build_shard(args.cfg, rank, args.topology.size, args.files, args.dtype, device)
    if device.type == "cpu":
        tune_malloc()
    try:
        _serve(model, channel, device)
    except RuntimeError as exc:  # NOTE: gloo raises once rank 0's sockets are closed
        log.info("the driver is gone (%s); exiting", exc)
        raise SystemExit(1) from exc
    finally:
        dist.destroy_process_group()


def _serve(model: TensorParallelLlama, channel: Channel, device: torch.device) -> None:
    runner = None
    while True:
        match records.decode(channel.recv()):
            case records.RunnerInit() as init:
                runner = _runner(model, init, device)
            case records.Propose(plan):
                assert runner is not None, "init first"
                runner.propose(plan)  # NOTE: rank 0 uses its own proposals (the same tokens)
            case records.Execute(plan):
                assert runner is not None, "init first"
                runner.execute(plan)  # NOTE: only rank 0's output is used
            case records.Stop():
                return


def _runner(model: TensorParallelLlama, init: records.RunnerInit, device: torch.device):
    from engine.run.runner import ModelRunner
    from engine.run.sampler import Sampler
    from kernels import get_backend

    return ModelRunner(
        model, init.num_blocks, init.block_size, init.max_model_len,
        Sampler(init.seed, device),
        get_backend(init.attention_backend, device.type), device,
        getattr(torch, init.kv_dtype), init.num_cpu_blocks, draft_layers=init.draft_layers,
        batch_invariant=init.batch_invariant)
