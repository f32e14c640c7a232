"""A tensor-parallel worker process (every rank but 0): loads its shard, then replays every op
the driver sends on the channel (forward, logits, block copies) on its own KV cache shard.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from pathlib import Path

import torch
import torch.distributed as dist

from engine.allocator import tune_malloc
from engine.forward_context import ForwardContext, forward_context
from engine.models.config import ModelConfig
from engine.parallel import wire
from engine.parallel.group import Channel, Topology, join
from engine.parallel.layers import TensorParallelLlama, load_shard, shard_plan
from engine.step_plan import BlockCopy, CopyKind

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


@torch.inference_mode()
def _serve(model: TensorParallelLlama, channel: Channel, device: torch.device) -> None:
    from engine.runner import ModelRunner
    from kernels import get_backend

    runner: ModelRunner | None = None
    while True:
        op, fields, tensors = wire.decode(channel.recv(), device)
        if op == "init":
            runner = ModelRunner(
                model, fields["num_blocks"], fields["block_size"], fields["max_model_len"],
                None, get_backend(fields["backend"], device.type), device,  # type: ignore[arg-type]
                getattr(torch, fields["kv_dtype"]), fields["num_cpu_blocks"])
        elif op == "forward":
            assert runner is not None, "init first"
            meta = wire.meta_from_wire(fields, tensors)
            kwargs = {} if fields["num_layers"] is None else {"num_layers": fields["num_layers"]}
            with forward_context(ForwardContext(meta, runner.kv_caches, runner.backend)):
                model(tensors["input_ids"], tensors["positions"], **kwargs)
        elif op == "logits":
            model.compute_logits(tensors["hidden"])
        elif op == "copy":
            assert runner is not None, "init first"
            runner._copy_blocks([BlockCopy(CopyKind(k), src, dst)
                                 for k, src, dst in fields["copies"]])
        elif op == "stop":
            return
        else:
            raise ValueError(f"unknown op {op!r}")
