"""Fused float32 CPU ops of the Llama block in C (csrc/ops.c): residual add + RMSNorm, the
per-head q/k norms, rope, and the greedy sampler's argmax.

Each replaces several torch ops (RMSNorm alone is six, rope five with its table lookups) by one
call over the rows; in a decode step those ops are small and their fixed per-op cost is what
counts. `engine/models/llama.py` uses them where `set_fused_cpu_ops` turned them on (the
engine does with the `cpu` attention backend) and the tensors fit; the torch formulas otherwise.
"""

from __future__ import annotations

import torch

from kernels.cpu import library
from kernels.cpu.library import available, build_error

__all__ = ["add_rms_norm", "argmax", "available", "build_error", "fits", "rms_norm_heads",
           "rope", "rope_fits", "rope_input_fits"]


def fits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += x (in place, when given), then weight * RMSNorm of the sum (or of x).

    x, residual: [rows, hidden] contiguous float32; returns a new [rows, hidden] tensor.
    """
    hidden = weight.numel()
    out = torch.empty_like(x)
    library.load().add_rms_norm_f32(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.numel() // hidden, hidden, eps, torch.get_num_threads())
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, weight * RMSNorm of each head of x [tokens, heads, dim] (rows may be strided,
    heads contiguous: rope_input_fits), weight float32 [dim] contiguous: the same numbers as
    add_rms_norm over the heads as rows."""
    tokens, heads, dim = x.shape
    library.load().rms_norm_heads_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), tokens,
                                      heads, dim, eps, torch.get_num_threads())


def rope_fits(positions: torch.Tensor, cos: torch.Tensor) -> bool:
    """The tables and positions the kernel takes (x is checked per call: rope_input_fits)."""
    return (cos.dtype == torch.float32 and cos.device.type == "cpu" and cos.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous())


def rope_input_fits(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
            and x.stride()[1:] == (x.shape[2], 1))


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim] (rows may be strided) -> rotated, contiguous; cos and the signed
    sin are the full [max_positions, dim] tables, indexed by positions [tokens] here.

    positions are not bounds-checked: the runner's are below max_model_len, the tables' length.
    """
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    library.load().rope_f32(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), out.data_ptr(), tokens, heads, dim,
                            torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a float32 [rows, n] CPU tensor with contiguous rows (NaN and ties as
    torch: the first NaN, else the first largest), int64 [rows]; other tensors go to torch.
    NOTE: torch's CPU argmax is a scalar loop: 63 us on a 49152-logit row against ~5."""
    if not (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32
            and x.stride(1) == 1 and x.shape[1] > 0 and available()):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library.load().argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                   out.data_ptr(), torch.get_num_threads())
    return out
