"""The one step after loading that installs a model's CPU fast paths: packed dense linears,
one-call quantized MLPs, and (where the attention backend asks for them) the C norm and rope
kernels with the one-call decode stack. The model only keeps the slots this fills."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.cpu_linear import pack_linears, resolve_mode
from engine.models.fused_stack import DecodeStack
from engine.models.llama import MLP, LlamaForCausalLM, RMSNorm
from engine.models.quant_linear import QuantMLP
from kernels.cpu import ops as cpu_ops

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FastPaths:
    """What `accelerate` installed in one model."""

    cpu_linear: str  # the --cpu-linear mode applied to its dense linears (torch: none packed)
    fused_mlps: int  # MLPs whose gate/up, activation and down run as one kernel call
    fused_cpu_ops: bool  # RMSNorm (with its residual add) and rope in kernels/cpu/ops.py
    decode_stack: bool  # a plain decode step's whole layer stack in one C call


def accelerate(model: LlamaForCausalLM, *, cpu_linear: str, fused_cpu_ops: bool,
               device: torch.device, dtype: torch.dtype) -> FastPaths:
    """Install every fast path `model` can take, after its weights are loaded (and counted:
    packed and quantized weights are not Parameters).

    cpu_linear: the `--cpu-linear` mode (auto resolves here; torch packs nothing).
    fused_cpu_ops: the attention backend runs on these kernels (its FUSED_CPU_OPS); off, the
    norms and rope stay torch formulas and there is no decode stack: the reference path.
    """
    mode = resolve_mode(cpu_linear, model, device, dtype)
    pack_linears(model, mode)
    mlps = fuse_mlps(model)
    on = set_fused_cpu_ops(model, fused_cpu_ops)
    paths = FastPaths(cpu_linear=mode, fused_mlps=mlps, fused_cpu_ops=on,
                      decode_stack=model.decode_stack is not None)
    log.info("fast paths of %s: %s", model.cfg.architecture, paths)
    return paths


def fuse_mlps(model: nn.Module) -> int:
    """Give every MLP whose gate/up and down are packed quantized layers its one-call path;
    returns how many got it."""
    count = 0
    for m in model.modules():
        if isinstance(m, MLP) and QuantMLP.applies(m.gate_up_proj, m.down_proj):
            m.fused = QuantMLP(m.gate_up_proj, m.down_proj, "gelu_tanh" if m.gelu else "silu")
            count += 1
    return count


def set_fused_cpu_ops(model: LlamaForCausalLM, on: bool) -> bool:
    """Run RMSNorm (with its residual add) and rope in kernels/cpu/ops.py's C kernels where
    the tensors are float32 on the CPU; off: the torch formulas. On, a model of packed
    quantized layers also gets its one-call decode stack. Returns whether it is on (not
    where the C kernels cannot be built)."""
    model.fused_cpu_ops = on = on and cpu_ops.available()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused = on
    model.decode_stack = DecodeStack.build(model) if on else None
    return on
