"""Every production launch configuration of the Triton kernels, compiled ahead of time for a
GPU target (no GPU needed): tests check that each builds a cubin without spills in Hopper's limits.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from itertools import product

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.attention import triton_backend as tb
from kernels.attention import triton_kernels as tk

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SMEM_BYTES = 232448  # 227 KiB: the most one block may opt into on sm_90
HEAD_DIMS = (64, 128)
KV_HEADS = 8
_I32 = "i32"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # readable id: kernel and its specialization
    fn: object  # the JITFunction
    signature: dict[str, str]  # argument -> triton type ("*bf16", "i32", "constexpr")
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # local memory (stack) per thread: register spills
    shared_bytes: int


def production_specs() -> list[KernelSpec]:
    """bf16 (with bf16 or fp8 KV) and fp16 models at head dims 64 and 128."""
    specs = []
    combos = [("bf16", "bf16"), ("bf16", "fp8e4nv"), ("fp16", "fp16")]
    for (dt, kv), hd in product(combos, HEAD_DIMS):
        scale_kind = 2 if kv == "fp8e4nv" else 0
        specs.append(_varlen(dt, kv, hd, scale_kind))
        specs += [_decode(dt, kv, hd, scale_kind, split) for split in (False, True)]
        if dt == "bf16":
            specs.append(_write(dt, kv, hd, scale_kind))
    specs += [_reduce(dt, hd) for dt, hd in product(("bf16", "fp16"), HEAD_DIMS)]
    return specs


def compile_spec(spec: KernelSpec, target: GPUTarget = HOPPER):
    src = ASTSource(spec.fn, spec.signature, constexprs=spec.constexprs, attrs=_attrs(spec))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    return triton.compile(src, target=target, options=options)


def resources(compiled) -> Resources:
    """Registers and spills from the cubin (triton's cuobjdump), shared memory from metadata."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    usage = dict(item.split(":", 1) for item in text.split("Function", 1)[1].split()[1:]
                 if ":" in item)
    spill = int(usage.get("LOCAL", 0)) + int(usage.get("STACK", 0))
    return Resources(int(usage["REG"]), spill, int(compiled.metadata.shared))


def _attrs(spec: KernelSpec) -> dict:
    # NOTE: what the JIT would specialize on real tensors: 16-byte aligned pointers and
    # strides divisible by 16; without it loads are not vectorized and resources differ.
    names = list(spec.signature)
    return {(names.index(n),): [["tt.divisibility", 16]] for n, t in spec.signature.items()
            if t.startswith("*") or n.startswith("stride_")}


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    return {n: ("constexpr" if n in constexprs else types.get(n, _I32)) for n in fn.arg_names}


def _attention_types(dt: str, kv: str) -> dict[str, str]:
    return {"out_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_cache_ptr": f"*{kv}",
            "v_cache_ptr": f"*{kv}", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sm_scale": "fp32"}


def _varlen(dt: str, kv: str, hd: int, scale_kind: int) -> KernelSpec:
    cfg = tb.varlen_config(hd)
    consts = dict(HEAD_DIM=hd, HEAD_DIM_P2=hd, PAGE_SIZE=16, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, KV_SCALE=scale_kind, UPCAST=False, DOT_PRECISION="tf32")
    fn = tk.paged_attention_kernel
    return KernelSpec(f"varlen-{dt}-kv_{kv}-d{hd}", fn,
                      _sig(fn, _attention_types(dt, kv), consts), consts,
                      cfg.num_warps, cfg.num_stages)


def _decode(dt: str, kv: str, hd: int, scale_kind: int, split: bool) -> KernelSpec:
    cfg = tb.decode_config(hd)
    consts = dict(HEAD_DIM=hd, HEAD_DIM_P2=hd, PAGE_SIZE=16, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, KV_SCALE=scale_kind, UPCAST=False, DOT_PRECISION="tf32",
                  SPLIT=split)
    fn = tk.decode_kernel
    return KernelSpec(f"decode-{dt}-kv_{kv}-d{hd}-split{int(split)}", fn,
                      _sig(fn, _attention_types(dt, kv), consts), consts,
                      cfg.num_warps, cfg.num_stages)


def _reduce(dt: str, hd: int) -> KernelSpec:
    consts = dict(HEAD_DIM=hd, HEAD_DIM_P2=hd, SPLITS_P2=tb.MAX_SPLITS)
    fn = tk.decode_reduce_kernel
    return KernelSpec(f"reduce-{dt}-d{hd}", fn, _sig(fn, _attention_types(dt, dt), consts),
                      consts, 4, 1)


def _write(dt: str, kv: str, hd: int, scale_kind: int) -> KernelSpec:
    consts = dict(NUM_KV_HEADS=KV_HEADS, HEAD_DIM=hd, HEAD_DIM_P2=hd, BLOCK_T=tb.WRITE_BLOCK_T,
                  QUANT=kv == "fp8e4nv", PER_HEAD_SCALE=scale_kind == 2, ROUND_IN_FP32=False)
    types = {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "k_cache_ptr": f"*{kv}",
             "v_cache_ptr": f"*{kv}", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32"}
    fn = tk.write_kv_kernel
    return KernelSpec(f"write_kv-{dt}-kv_{kv}-d{hd}", fn, _sig(fn, types, consts), consts, 4, 1)
