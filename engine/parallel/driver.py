"""The engine process's side of tensor parallelism: rank 0 runs in-process and stands in for
the model in the runner; each of its calls is first sent on the channel to ranks 1..N-1.
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

from engine.forward_context import get_forward_context
from engine.models.config import ModelConfig, from_hf_config
from engine.parallel import wire
from engine.parallel.group import Channel, Topology, join
from engine.parallel.layers import TensorParallelLlama
from engine.parallel.worker import WorkerArgs, build_shard, start_workers
from engine.step_plan import BlockCopy
from ipc import exit_codes
from ipc.config import EngineConfig
from ipc.model_source import ModelSource

log = logging.getLogger("engine.parallel.driver")
_DEATH_GRACE_S = 10.0  # after a worker dies: time for the step to fail by itself


class TensorParallelModel:
    """Rank 0's shard behind LlamaForCausalLM's interface, as the ModelRunner uses it."""

    def __init__(self, model: TensorParallelLlama, channel: Channel,
                 procs: list[mp.process.BaseProcess], backend: str) -> None:
        self.model, self.cfg = model, model.cfg  # NOTE: cfg is the shard's: KV cache per rank
        self._channel, self._procs, self._backend = channel, procs, backend
        self._stopping = False
        threading.Thread(target=self._watch_workers, name="tp-watchdog", daemon=True).start()

    def parameters(self):
        return self.model.parameters()

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        self.model.init_rope(max_positions, device)

    def start_workers(self, num_blocks: int, block_size: int, max_model_len: int,
                      kv_dtype: torch.dtype, num_cpu_blocks: int) -> None:
        """Workers build their runners (KV cache shards) with the engine's sizes."""
        self._send("init", {"num_blocks": num_blocks, "block_size": block_size,
                            "max_model_len": max_model_len, "backend": self._backend,
                            "kv_dtype": str(kv_dtype).removeprefix("torch."),
                            "num_cpu_blocks": num_cpu_blocks})

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 num_layers: int | None = None) -> torch.Tensor:
        fields, tensors = wire.meta_to_wire(get_forward_context().attn_metadata)
        self._send("forward", {**fields, "num_layers": num_layers},
                   {**tensors, "input_ids": input_ids, "positions": positions})
        kwargs = {} if num_layers is None else {"num_layers": num_layers}
        return self.model(input_ids, positions, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send("logits", {}, {"hidden": hidden})
        return self.model.compute_logits(hidden)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        self._send("copy", {"copies": [[int(c.kind), c.src, c.dst] for c in copies]})

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._workers_alive():
            try:
                self._send("stop")
            except RuntimeError as exc:  # NOTE: a rank on another node may be gone
                log.warning("could not stop the workers cleanly: %s", exc)
        for proc in self._procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _send(self, op: str, fields: dict | None = None,
              tensors: dict[str, torch.Tensor] | None = None) -> None:
        self._channel.send(wire.encode(op, fields or {}, tensors or {}))

    def _workers_alive(self) -> bool:
        return all(p.exitcode is None for p in self._procs)

    def _watch_workers(self) -> None:
        # NOTE: a worker's death normally fails the step (the ring or a collective raises) and
        # the engine loop sends EngineDead; if a collective blocks instead, exit so the gateway
        # sees the process end rather than a hang.
        while not self._stopping:
            time.sleep(0.5)
            dead = [p for p in self._procs if p.exitcode is not None]
            if dead and not self._stopping:
                log.error("tensor-parallel worker %s exited with %s", dead[0].name,
                          dead[0].exitcode)
                time.sleep(_DEATH_GRACE_S)
                if not self._stopping:
                    os._exit(exit_codes.ENGINE_DIED)


# NOTE: the Llama layout with q/k/v and gate/up stored apart (the shard loader splits them)
TP_ARCHITECTURES = {"llama", "smollm", "mistral", "qwen2", "qwen3"}


def launch(config: EngineConfig, source: ModelSource, dtype: torch.dtype,
           device: torch.device) -> tuple[TensorParallelModel, ModelConfig]:
    """Start this node's ranks 1..k-1, join the group as rank 0 (with the ranks of every other
    node, started by `serve --headless`), load rank 0's shard."""
    if config.node_rank != 0:
        raise ValueError("node_rank: the engine (the scheduler and rank 0) runs on node 0; "
                         "run the other nodes with `pagedserve serve --headless`")
    cfg, files = checkpoint(source)
    topology = Topology.from_config(config)
    args = WorkerArgs(topology, cfg, files, dtype, device.type, config.num_threads)
    procs = start_workers(args, topology.local_ranks[1:])
    channel = _join_group(topology, device, procs)
    model = TensorParallelModel(build_shard(cfg, 0, topology.size, files, dtype, device),
                                channel, procs, config.attention_backend)
    atexit.register(model.shutdown)
    return model, cfg


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
