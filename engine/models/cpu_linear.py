"""Linear layers with oneDNN-prepacked weights: faster few-row products on the CPU.

On this AVX-512 CPU in float32, `F.linear` with 4-16 rows costs 1.5-2x its one-row product
(MKL's small-M path), while the same product on weights reordered once into oneDNN's blocked
layout stays near the one-row cost. With one or two rows the plain product is as fast or
faster, so `dual` keeps both layouts and picks by row count (`python -m bench.cpu_linear`).

Modes (`--cpu-linear`): `torch` (checkpoint layout, the reference), `onednn` (packed only, same
memory), `dual` (both: dense up to DENSE_MAX_ROWS rows, packed above; the linear weights twice),
`auto` (dual on a float32 CPU model when the second copy fits in a quarter of the free host
memory, else torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "torch", "onednn", "dual")
# NOTE: bench/cpu_linear.py on the bundled model (1 and 2 threads): the prepacked product
# alone is 0.85-0.97x the plain one at 1-3 rows and 1.1-1.8x from 4 rows up.
DENSE_MAX_ROWS = 3


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight is also (or only) held in oneDNN's reordered layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_dense: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        # NOTE: not Parameters: the packed copy is an opaque mkldnn tensor and the dense one
        # may be shared with the embedding (tied LM head).
        self.dense = weight.detach() if keep_dense else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() <= DENSE_MAX_ROWS * self.in_features:
            return F.linear(x, self.dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dense={self.dense is not None}")


def resolve_mode(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """The mode `pack_linears` applies: auto and impossible requests become a concrete one."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear must be one of {MODES}")
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_available()
    if mode in ("onednn", "dual") and not usable:
        raise ValueError(f"cpu_linear {mode} needs a float32 model on a CPU with oneDNN")
    if mode != "auto":
        return mode
    if not usable:
        return "torch"
    extra = sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))
    return "dual" if extra <= _available_bytes() / 4 else "torch"


def pack_linears(model: nn.Module, mode: str) -> None:
    """Replace every plain `nn.Linear` of `model` (and its tied LM head) in place."""
    if mode == "torch":
        return
    keep_dense = mode == "dual"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # NOTE: not subclasses (tensor-parallel layers)
                setattr(parent, name, PackedLinear(child.weight, child.bias, keep_dense))
    if (embed := _tied_embedding(model)) is not None:
        # NOTE: a tied head keeps the embedding as its dense copy at no cost: always dual.
        model.lm_head = PackedLinear(embed.weight, None, keep_dense=True)


def _tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding that doubles as the LM head (lm_head None), if the model has one."""
    embed = getattr(model, "embed_tokens", None)
    tied = getattr(model, "lm_head", False) is None and type(embed) is nn.Embedding
    return embed if tied else None


def _linears(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if type(m) is nn.Linear]
    if (embed := _tied_embedding(model)) is not None:
        found.append(embed)  # the tied head's packed copy
    return found


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
