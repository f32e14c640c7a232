"""Adapters by name: the registry (name -> path, id), an LRU of max_cpu_loras read adapters in
host memory, and max_loras device slots (stacked A/B per adapted linear) that a step's
adapters are copied into; it wraps the model's linears once (and hands the same slots to the
model's one-call MLPs and decode stack) and builds each step's LoraBatch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.lora_batch import LoraBatch
from engine.run.lora.adapter import TARGETS, LoraWeights, read_adapter
from engine.run.lora.layers import LoraLinear
from kernels.cpu.lora import SlotWeights


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int  # device slots: distinct adapters in one step
    max_lora_rank: int
    max_cpu_loras: int  # adapters kept read in host memory (the rest re-read from disk)


_PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class _Target:
    parts: list[int]  # output rows of each part (q, k, v or gate, up, or one)
    a: torch.Tensor  # [max_loras, len(parts) * max_rank, in]
    # [max_loras, len(parts) * max_rank, out]: B transposed, so that the C kernels' second
    # product runs along contiguous output features
    bt: torch.Tensor


class LoraSlots:
    def __init__(self, model: nn.Module, limits: LoraLimits, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.limits, self.dtype, self.device = limits, dtype, device
        cfg = model.cfg
        self.num_layers = cfg.num_layers
        self.targets: dict[tuple[int, str], _Target] = {}
        for i, layer in enumerate(model.layers):
            self._wrap(i, layer, cfg)
        self._attach(model)
        self.paths: dict[str, tuple[int, str]] = {}  # name -> (id, path)
        self._next_id = 1
        self._cpu: OrderedDict[int, LoraWeights] = OrderedDict()  # id -> weights, LRU first
        self._slots: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU first

    def _wrap(self, i: int, layer: nn.Module, cfg) -> None:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {"qkv_proj": (layer.self_attn, h, [q, kv, kv]),
                  "o_proj": (layer.self_attn, q, [h]),
                  "gate_up_proj": (layer.mlp, h, [inter, inter]),
                  "down_proj": (layer.mlp, inter, [h])}
        r, n = self.limits.max_lora_rank, self.limits.max_loras
        for name, (parent, fan_in, parts) in shapes.items():
            kw = {"dtype": self.dtype, "device": self.device}
            t = _Target(parts, torch.zeros(n, len(parts) * r, fan_in, **kw),
                        torch.zeros(n, len(parts) * r, sum(parts), **kw))
            self.targets[(i, name)] = t
            setattr(parent, name, LoraLinear(getattr(parent, name), self.weights(i, name)))

    def weights(self, layer: int, name: str) -> SlotWeights:
        """The slots of one adapted linear (`name` one of qkv/o/gate_up/down_proj)."""
        t = self.targets[(layer, name)]
        return SlotWeights(t.a, t.bt)

    def _attach(self, model: nn.Module) -> None:
        """The fast paths that bypass the linears add the same slots' deltas themselves."""
        for i, layer in enumerate(model.layers):
            if layer.mlp.fused is not None:
                layer.mlp.fused.attach_lora(self.weights(i, "gate_up_proj"),
                                            self.weights(i, "down_proj"))
        if model.decode_stack is not None:
            model.decode_stack.attach_lora(
                [tuple(self.weights(i, name) for name in _PRODUCTS)
                 for i in range(self.num_layers)])

    # ---- registry ---------------------------------------------------------------------------

    def add(self, name: str, path: str) -> int:
        """Read and check the adapter, register it under `name`; its id. ValueError (naming
        the adapter) leaves everything as it was."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        weights = self._read(name, path)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        self.paths[name] = (lora_id, path)
        self._cache(lora_id, weights)
        return lora_id

    def remove(self, name: str) -> int:
        """Forget the adapter: its host copy and its slot are freed; its id."""
        lora_id, _ = self.paths.pop(name)
        self._cpu.pop(lora_id, None)
        self._slots.pop(lora_id, None)
        return lora_id

    def id_of(self, name: str) -> int | None:
        entry = self.paths.get(name)
        return None if entry is None else entry[0]

    def _read(self, name: str, path: str) -> LoraWeights:
        w = read_adapter(name, path, self.limits.max_lora_rank, self.num_layers, self.dtype)
        for (layer, hf), m in w.modules.items():
            fused, part = TARGETS[hf]
            t = self.targets[(layer, fused)]
            fan_in = t.a.shape[2]
            if m.a.shape[1] != fan_in or m.b.shape[0] != t.parts[part]:
                raise ValueError(
                    f"LoRA adapter {name!r}: layer {layer} {hf} is {m.b.shape[0]}x"
                    f"{m.a.shape[1]}; the model's is {t.parts[part]}x{fan_in}")
        return w

    def _cache(self, lora_id: int, weights: LoraWeights) -> None:
        self._cpu[lora_id] = weights
        self._cpu.move_to_end(lora_id)
        while len(self._cpu) > self.limits.max_cpu_loras:
            self._cpu.popitem(last=False)

    # ---- steps ------------------------------------------------------------------------------

    def batch(self, rows: Iterable[tuple[int | None, int]]) -> LoraBatch | None:
        """The LoraBatch of a step whose rows are (adapter id or None, tokens), in batch
        order; None when no row has an adapter (the base model's fast paths then run)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        ids: list[tuple[int | None, int]] = []
        start = 0
        for lora_id, n in rows:
            ids.append((lora_id, n))
            if lora_id is not None:
                own = spans.setdefault(lora_id, [])
                if own and own[-1][1] == start:  # NOTE: adjacent rows: one contiguous span
                    own[-1] = (own[-1][0], start + n)
                else:
                    own.append((start, start + n))
            start += n
        if not spans:
            return None
        slots = self._assign(list(spans))
        groups = [(slots[i], _rows(s, self.device)) for i, s in spans.items()]
        row_slots = None
        if self.device.type == "cpu":  # NOTE: the C kernels' form (one slot per token row)
            per_token = [-1 if i is None else slots[i] for i, n in ids for _ in range(n)]
            row_slots = torch.tensor(per_token, dtype=torch.int32)
        return LoraBatch(groups, row_slots)

    def _assign(self, ids: list[int]) -> dict[int, int]:
        if len(ids) > self.limits.max_loras:
            raise RuntimeError(f"a step with {len(ids)} adapters; max_loras is "
                               f"{self.limits.max_loras} (the scheduler caps this)")
        for lora_id in ids:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            used = set(self._slots.values())
            free = [s for s in range(self.limits.max_loras) if s not in used]
            if not free:  # NOTE: evict the least recently used adapter not in this step
                victim = next(k for k in self._slots if k not in ids)
                free = [self._slots.pop(victim)]
            self._fill(free[0], lora_id)
            self._slots[lora_id] = free[0]
        return {i: self._slots[i] for i in ids}

    def _fill(self, slot: int, lora_id: int) -> None:
        weights = self._cpu.get(lora_id)
        if weights is None:  # NOTE: evicted from host memory: read again (checked at add)
            name, path = next((n, p) for n, (i, p) in self.paths.items() if i == lora_id)
            weights = self._read(name, path)
        self._cache(lora_id, weights)
        r = self.limits.max_lora_rank
        for t in self.targets.values():
            t.a[slot].zero_()
            t.bt[slot].zero_()
        for (layer, hf), m in weights.modules.items():
            fused, part = TARGETS[hf]
            t = self.targets[(layer, fused)]
            rank, col0 = m.a.shape[0], sum(t.parts[:part])
            t.a[slot, part * r : part * r + rank] = m.a
            t.bt[slot, part * r : part * r + rank, col0 : col0 + t.parts[part]] = m.b.T

    # ---- counters ---------------------------------------------------------------------------

    @property
    def num_slots_used(self) -> int:
        return len(self._slots)

    @property
    def cpu_bytes(self) -> int:
        """Host bytes of the read adapters (the slots are allocated once, at start)."""
        return sum(w.nbytes for w in self._cpu.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of the adapters in device slots (their ranks' share of the slot tensors)."""
        return sum(self._cpu[i].nbytes if i in self._cpu else 0 for i in self._slots)


def _rows(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
