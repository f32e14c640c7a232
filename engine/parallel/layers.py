"""Tensor-parallel Llama: which heads, MLP columns and vocab rows each rank holds, the layers
that all-reduce / all-gather through torch.distributed, and a loader that reads only a shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, kv_scale_name


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds; every range is [start, stop) in the full model."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of n items split as evenly as possible (the first n % parts get one more)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (i < extra)


def shard_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    """Whole GQA groups per rank when there are at least `size` KV heads (uneven counts are
    fine); otherwise each rank holds one KV head, replicated on the ranks sharing it, and a
    slice of that head's query group."""
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads >= size:
        kv = _split(cfg.num_kv_heads, size, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        if size % cfg.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {size} must divide or be a multiple of "
                             f"the model's {cfg.num_kv_heads} KV heads")
        per_head = size // cfg.num_kv_heads  # ranks sharing one KV head
        head = rank // per_head
        if group < per_head:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's "
                             f"{cfg.num_heads} query heads")
        kv = (head, head + 1)
        lo, hi = _split(group, per_head, rank % per_head)
        q = (head * group + lo, head * group + hi)
    return ShardPlan(rank, size, q, kv, _split(cfg.intermediate_size, size, rank),
                     _split(cfg.vocab_size, size, rank))


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of one rank's shard: its heads, MLP width and vocab rows."""
    return dataclasses.replace(
        cfg, num_heads=plan.q_heads[1] - plan.q_heads[0],
        num_kv_heads=plan.kv_heads[1] - plan.kv_heads[0],
        intermediate_size=plan.intermediate[1] - plan.intermediate[0],
        vocab_size=plan.vocab[1] - plan.vocab[0])


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T): the input's columns are split across ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its vocab range, zeros elsewhere; all_reduce sums them."""

    def __init__(self, vocab: tuple[int, int], hidden: int) -> None:
        super().__init__()
        self.start, self.stop = vocab
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        out = F.embedding((ids - self.start) * mine, self.weight)  # [num_tokens, hidden]
        out = out * mine.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out)
        return out


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard: the Llama modules at local sizes, with row-parallel o_proj and
    down_proj, a vocab-parallel embedding, and logits all-gathered over the vocab."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan) -> None:
        local = local_config(cfg, plan)
        super().__init__(local)
        self.full_cfg, self.plan = cfg, plan
        self.embed_tokens = VocabParallelEmbedding(plan.vocab, cfg.hidden_size)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size, bias=False)
            mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size,
                                              bias=False)
        self._vocab_sizes = [_split(cfg.vocab_size, plan.size, r) for r in range(plan.size)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = super().compute_logits(hidden)  # [n, local vocab] float32
        width = max(b - a for a, b in self._vocab_sizes)
        padded = F.pad(local, (0, width - local.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.plan.size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:, : b - a] for p, (a, b) in zip(parts, self._vocab_sizes,
                                                              strict=True)], dim=1)


# ---- sharded loading -----------------------------------------------------------------------

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def load_shard(model: TensorParallelLlama, files: list[Path]) -> None:
    """Copy this rank's slice of each checkpoint tensor, read through safetensors slices (the
    file is mmapped: only the slice's pages are read)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if (scale := kv_scale_name(hf_name.removeprefix("model."))) is not None:
                    model.set_kv_scale(*scale, _local_scale(model.plan, f.get_tensor(hf_name)))
                    continue
                for target, rows, tensor in _shard(model, hf_name, f.get_slice(hf_name)):
                    with torch.no_grad():
                        params[target][rows[0] : rows[1]].copy_(tensor)
                    loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


def _local_scale(plan: ShardPlan, scale: torch.Tensor) -> torch.Tensor:
    """A per-head KV scale keeps this rank's KV heads; a per-tensor one is shared."""
    flat = scale.reshape(-1)
    return flat if flat.numel() == 1 else flat[plan.kv_heads[0] : plan.kv_heads[1]]


def _shard(model: TensorParallelLlama, hf_name: str, sl) -> Iterator[tuple[str, tuple, object]]:
    """(our parameter, its row range to fill, the slice of the checkpoint tensor)."""
    cfg, plan, d = model.full_cfg, model.plan, model.full_cfg.head_dim
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name:
        return
    if name == "lm_head.weight":
        if model.lm_head is not None:
            yield name, (0, plan.vocab[1] - plan.vocab[0]), sl[plan.vocab[0] : plan.vocab[1]]
        return
    if name == "embed_tokens.weight":
        yield name, (0, plan.vocab[1] - plan.vocab[0]), sl[plan.vocab[0] : plan.vocab[1]]
        return
    part = name.split(".")[-2]
    if part in _QKV:
        heads = plan.q_heads if part == "q_proj" else plan.kv_heads
        n_q = (plan.q_heads[1] - plan.q_heads[0]) * d
        n_kv = (plan.kv_heads[1] - plan.kv_heads[0]) * d
        start = [0, n_q, n_q + n_kv][_QKV[part]]
        n = n_q if part == "q_proj" else n_kv
        yield (name.replace(part, "qkv_proj"), (start, start + n),
               sl[heads[0] * d : heads[1] * d])
    elif part in _GATE_UP:
        a, b = plan.intermediate
        start = _GATE_UP[part] * (b - a)
        yield name.replace(part, "gate_up_proj"), (start, start + b - a), sl[a:b]
    elif part == "o_proj":
        yield name, (0, cfg.hidden_size), sl[:, plan.q_heads[0] * d : plan.q_heads[1] * d]
    elif part == "down_proj":
        yield name, (0, cfg.hidden_size), sl[:, plan.intermediate[0] : plan.intermediate[1]]
    else:  # norms: replicated
        yield name, (0, sl.get_shape()[0]), sl[:]
