"""Linear layers with prepacked weights: faster few-row products on the CPU.

On this AVX-512 CPU in float32, `F.linear` with 4-16 rows costs 1.5-2x its one-row product
(MKL's small-M path), while the same product on weights reordered once stays near the one-row
cost. Two packed layouts are used: MKL's packed GEMM (`cblas_sgemm_pack`) is the fastest from 1
to 64 rows, oneDNN's blocked layout above that (prefill chunks); `python -m bench.cpu_linear`.

Modes (`--cpu-linear`): `torch` (checkpoint layout, the reference), `onednn` (oneDNN-packed
only, same memory), `dual` (MKL-packed up to SMALL_MAX_ROWS rows, oneDNN-packed above: the
linear weights twice; where torch lacks MKL's packed GEMM, the dense weight up to
DENSE_MAX_ROWS rows instead), `auto` (dual on a float32 CPU model when the second copy fits in
a quarter of the free host memory, else torch).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "torch", "onednn", "dual")
# NOTE: bench/cpu_linear.py on the bundled model, whole forward passes: MKL-packed is 1.0x the
# plain product at 1-3 rows and 1.05-1.2x oneDNN-packed at 4-32, even at 64 and 0.87-0.94x
# from 96 rows up; oneDNN-packed alone is 0.85-0.97x the plain product at 1-3 rows.
SMALL_MAX_ROWS = 64
DENSE_MAX_ROWS = 3
MKL_PACK_ROWS = 32  # the row count MKL is told to pack for; it computes any count (checked)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def mkl_packed_available() -> bool:
    """MKL's packed GEMM is in this torch, and a layout packed for MKL_PACK_ROWS rows gives
    the right product at other row counts (torch's own use only ever passes the packed count)."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS)
    for rows in (1, 5, MKL_PACK_ROWS + 3):
        x = torch.randn(rows, 24, generator=gen)
        got = torch.ops.mkl._mkl_linear(x, packed, w, None, rows).double()
        if not torch.allclose(got, x.double() @ w.double().T, rtol=1e-5, atol=1e-5):
            return False
    return True


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight is held in oneDNN's reordered layout, plus, for few-row
    products, either MKL's packed layout (`small="mkl"`) or the dense weight (`small="dense"`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small: str | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        # NOTE: not Parameters: the packed copies are opaque mkldnn tensors and the dense one
        # may be shared with the embedding (tied LM head).
        self.small = small
        self.dense = weight if small == "dense" else None
        self.mkl = None
        if small == "mkl":
            self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            # NOTE: _mkl_linear reads only the shape and dtype of the dense weight when the
            # row count equals the packed one (we always pass it so): a zero-stride stand-in
            self.shape = torch.empty(1, 1, dtype=weight.dtype).expand(weight.shape)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.mkl is not None and rows <= SMALL_MAX_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.mkl, self.shape, self.bias, rows)
        if self.dense is not None and rows <= DENSE_MAX_ROWS:
            return F.linear(x, self.dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, small={self.small}")


def resolve_mode(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """The mode `pack_linears` applies: auto and impossible requests become a concrete one."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear must be one of {MODES}")
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_available()
    if mode in ("onednn", "dual") and not usable:
        raise ValueError(f"cpu_linear {mode} needs a float32 model on a CPU with oneDNN")
    if mode != "auto":
        return mode
    linears = _linears(model)
    # NOTE: nothing to pack (a quantized model): torch, without dual's MKL probe, which
    # paged in 9 MiB of libtorch_cpu's code at ready (3 MiB after the first requests, whose
    # prefill GEMMs run part of it anyway)
    if not usable or not linears:
        return "torch"
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return "dual" if extra <= _available_bytes() / 4 else "torch"


def pack_linears(model: nn.Module, mode: str) -> None:
    """Replace every plain `nn.Linear` of `model` (and its tied LM head) in place."""
    if mode == "torch":
        return
    small = None
    if mode == "dual":
        small = "mkl" if mkl_packed_available() else "dense"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # NOTE: not subclasses (tensor-parallel layers)
                setattr(parent, name, PackedLinear(child.weight, child.bias, small))
    if (embed := _tied_embedding(model)) is not None:
        # NOTE: a tied head has the embedding as a dense copy at no cost
        model.lm_head = PackedLinear(embed.weight, None, small or "dense")


def _tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding that doubles as the LM head (lm_head None), if the model has one (a
    cross-encoder, with a score head, has no LM head at all)."""
    embed = getattr(model, "embed_tokens", None)
    tied = (getattr(model, "lm_head", False) is None and getattr(model, "score", None) is None
            and type(embed) is nn.Embedding)
    return embed if tied else None


def _linears(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if type(m) is nn.Linear]
    if (embed := _tied_embedding(model)) is not None:
        found += [embed, embed]  # the tied head's packed copies (its dense one is the embedding)
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
