"""The tensor-parallel process group: which ranks live on which node, how they meet
(torch.distributed over TCP: NCCL for the model's collectives on GPUs, gloo on CPUs), and the
channel that carries rank 0's records to every other rank, on this node or another.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ipc.config import EngineConfig

# NOTE: how long the ranks wait for each other to join (a node started later, a model load)
JOIN_TIMEOUT = timedelta(seconds=120)
# NOTE: a rank waits on the channel for as long as the engine is idle; a peer that dies closes
# its sockets, which fails the wait at once, so this bound is only for a peer that hangs.
IDLE_TIMEOUT = timedelta(days=30)
_LEN_DTYPE = torch.int64


@dataclass(frozen=True)
class Topology:
    """`size` ranks over `nnodes` nodes, `size // nnodes` per node in rank order."""

    size: int
    nnodes: int
    node_rank: int
    init_method: str  # tcp://master_addr:master_port

    @classmethod
    def from_config(cls, config: EngineConfig) -> Topology:
        port = config.master_port or _free_port(config.master_addr)
        return cls(config.tensor_parallel_size, config.nnodes, config.node_rank,
                   f"tcp://{config.master_addr}:{port}")

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node,
                     (self.node_rank + 1) * self.ranks_per_node)

    def device(self, rank: int, device_type: str) -> torch.device:
        """cuda:<local rank> on GPUs (each node numbers its own devices), else the CPU."""
        if device_type == "cuda":
            return torch.device("cuda", rank % self.ranks_per_node)
        return torch.device(device_type)


class Channel:
    """Rank 0 sends one bytes record per call; every other rank receives the records in order.

    A gloo group of all ranks (also on GPUs, beside NCCL's: the records are host bytes) and two
    broadcasts per record: its length, then its bytes. Works across nodes, unlike shared memory.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._len = torch.zeros(1, dtype=_LEN_DTYPE)

    def send(self, payload: bytes) -> None:
        self._len[0] = len(payload)
        dist.broadcast(self._len, 0, group=self._group)
        # NOTE: frombuffer needs a writable buffer; the bytearray is one copy of the record
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(0, dtype=torch.uint8)
        dist.broadcast(data, 0, group=self._group)

    def recv(self) -> bytes:
        dist.broadcast(self._len, 0, group=self._group)
        data = torch.empty(int(self._len[0]), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self._group)
        return data.numpy().tobytes()


def join(topology: Topology, rank: int, device: torch.device) -> Channel:
    """Join the group as `rank` (blocks until all `size` ranks have joined); the channel."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=topology.init_method, rank=rank,
                            world_size=topology.size, timeout=JOIN_TIMEOUT)
    return Channel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
