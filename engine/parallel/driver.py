"""The engine process's side of tensor parallelism: it starts this node's other ranks, joins
the group as rank 0, and runs rank 0's ModelRunner behind TensorParallelRunner, which sends
every plan to the other ranks before running it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.models.config import ModelConfig, from_hf_config
from engine.parallel import records
from engine.parallel.group import Channel, Topology, join
from engine.parallel.layers import TensorParallelLlama
from engine.parallel.worker import WorkerArgs, build_shard, start_workers
from engine.run.runner import ModelRunner
from engine.step_plan import DraftProposals, RunnerOutput, StepPlan
from ipc import exit_codes
from ipc.config import EngineConfig
from ipc.model_source import ModelSource

log = logging.getLogger("engine.parallel.driver")
_DEATH_GRACE_S = 10.0  # after a worker dies: time for the step to fail by itself


class Ranks:
    """Ranks 1..N-1 as rank 0 sees them: the channel to all of them, and this node's worker
    processes (watched: a death ends the engine even if a collective would block)."""

    def __init__(self, channel: Channel, procs: list[mp.process.BaseProcess]) -> None:
        self._channel, self._procs = channel, procs
        self._stopping = False
        threading.Thread(target=self._watch_workers, name="tp-watchdog", daemon=True).start()

    def send(self, record: records.Record) -> None:
        self._channel.send(records.encode(record))

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if all(p.exitcode is None for p in self._procs):
            try:
                self.send(records.Stop())
            except RuntimeError as exc:  # NOTE: a rank on another node may be gone
                log.warning("could not stop the workers cleanly: %s", exc)
        for proc in self._procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _watch_workers(self) -> None:
        # NOTE: a worker's death normally fails the step (a broadcast or collective raises)
        # and the engine loop sends EngineDead; if a collective blocks instead, exit so the
        # gateway sees the process end rather than a hang.
        while not self._stopping:
            time.sleep(0.5)
            dead = [p for p in self._procs if p.exitcode is not None]
            if dead and not self._stopping:
                log.error("tensor-parallel worker %s exited with %s", dead[0].name,
                          dead[0].exitcode)
                time.sleep(_DEATH_GRACE_S)
                if not self._stopping:
                    os._exit(exit_codes.ENGINE_DIED)


class TensorParallelRunner:
    """Rank 0's runner under tensor parallelism: each call's plan goes to every other rank,
    then runs here. Every rank runs the same ModelRunner over its shard and its KV caches, so
    block copies and swaps run everywhere from the plan.

    NOTE: collectives must match across ranks in count and order. They do because each rank
    runs the same code on the same plan: per forward one all-reduce for the embedding and two
    per layer; one all-gather per compute_logits call (each prompt-logprob chunk, the sampled
    rows, each self-draft position). Every rank also samples: the logits are all-gathered
    (the same bytes on every rank) and every generator is seeded alike (the engine seed,
    request seeds), so each rank draws the same tokens, and a self draft's next input is the
    same on every rank. Only rank 0's output is used.
    """

    def __init__(self, runner: ModelRunner, ranks: Ranks, init: records.RunnerInit) -> None:
        self.runner, self.ranks = runner, ranks
        ranks.send(init)

    def propose(self, plan: StepPlan) -> DraftProposals:
        self.ranks.send(records.Propose(plan))
        return self.runner.propose(plan)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.ranks.send(records.Execute(plan))
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.ranks.shutdown()


# NOTE: the Llama layout with q/k/v and gate/up stored apart (the shard loader splits them)
TP_ARCHITECTURES = {"llama", "smollm", "mistral", "qwen2", "qwen3"}


def launch(config: EngineConfig, source: ModelSource, dtype: torch.dtype,
           device: torch.device) -> tuple[TensorParallelLlama, ModelConfig, Ranks]:
    """Start this node's ranks 1..k-1, join the group as rank 0 (with the ranks of every other
    node, started by `serve --headless`); rank 0's shard, the full config, the other ranks."""
    if config.node_rank != 0:
        raise ValueError("node_rank: the engine (the scheduler and rank 0) runs on node 0; "
                         "run the other nodes with `pagedserve serve --headless`")
    cfg, files = checkpoint(source)
    topology = Topology.from_config(config)
    args = WorkerArgs(topology, cfg, files, dtype, device.type, config.num_threads)
    procs = start_workers(args, topology.local_ranks[1:])
    ranks = Ranks(_join_group(topology, device, procs), procs)
    atexit.register(ranks.shutdown)
    return build_shard(cfg, 0, topology.size, files, dtype, device), cfg, ranks


def _join_group(topology: Topology, device: torch.device,
                procs: list[mp.process.BaseProcess]) -> Channel:
    """Join as rank 0, failing fast if a local worker dies before it joins."""
    joined: list[Channel] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            joined.append(join(topology, 0, device))
        except BaseException as exc:  # NOTE: handed to the caller's thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and thread.is_alive():
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited with "
                               f"{dead[0].exitcode} during startup")
    if errors:
        raise errors[0]
    return joined[0]


def checkpoint(source: ModelSource) -> tuple[ModelConfig, list[Path]]:
    """The config and the safetensors files each rank reads its shard from (a GGUF is
    dequantized once into a cached safetensors file first, on each node)."""
    if source.is_gguf:
        from engine.models.loader import _gguf_dequantized, float32_cache

        cfg, _ = _gguf_dequantized(source)  # NOTE: writes the cache on first use
        files = [float32_cache(source)]
    else:
        cfg, files = from_hf_config(source.path), sorted(source.path.glob("*.safetensors"))
    if cfg.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size > 1 covers {sorted(TP_ARCHITECTURES)}; the "
                         f"model is {cfg.architecture!r}")
    return cfg, files
