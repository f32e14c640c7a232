"""A tensor-parallel worker process (ranks 1..N-1): loads its shard, then replays every op the
driver writes to the ring (forward, logits, block copies) on its own KV cache shard.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.allocator import tune_malloc
from engine.forward_context import ForwardContext, forward_context
from engine.models.config import ModelConfig
from engine.parallel import wire
from engine.parallel.layers import TensorParallelLlama, load_shard, shard_plan
from engine.parallel.shm_ring import RingClosedError, ShmRing
from engine.step_plan import BlockCopy, CopyKind

log = logging.getLogger("engine.parallel.worker")
INIT_TIMEOUT = timedelta(seconds=120)


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    rank: int
    size: int
    init_method: str  # tcp://127.0.0.1:port of the driver's rendezvous
    ring_name: str
    cfg: ModelConfig
    files: list[Path]
    dtype: torch.dtype
    device: str
    num_threads: int | None
    parent_pid: int


def init_distributed(rank: int, size: int, init_method: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=INIT_TIMEOUT)


def build_shard(cfg: ModelConfig, rank: int, size: int, files: list[Path], dtype: torch.dtype,
                device: torch.device) -> TensorParallelLlama:
    with torch.device("meta"):
        model = TensorParallelLlama(cfg, shard_plan(cfg, rank, size))
    model = model.to(dtype).to_empty(device=device)
    load_shard(model, files)
    return model.eval().requires_grad_(False)


def worker_main(args: WorkerArgs) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-worker{args.rank}[%(process)d] %(message)s")
    torch.set_num_threads(args.num_threads or 1)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    init_distributed(args.rank, args.size, args.init_method, device)
    model = build_shard(args.cfg, args.rank, args.size, args.files, args.dtype, device)
    if device.type == "cpu":
        tune_malloc()
    ring = ShmRing(args.size - 1, name=args.ring_name)
    try:
        _serve(model, ring, args, device)
    except RingClosedError:
        log.info("the driver is gone; exiting")
    finally:
        ring.close()


@torch.inference_mode()
def _serve(model: TensorParallelLlama, ring: ShmRing, args: WorkerArgs,
           device: torch.device) -> None:
    from engine.runner import ModelRunner
    from kernels import get_backend

    def alive() -> bool:
        return os.getppid() == args.parent_pid

    runner: ModelRunner | None = None
    while True:
        op, fields, tensors = wire.decode(ring.read(args.rank - 1, alive), device)
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
