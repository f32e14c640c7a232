"""engine/models/accelerate.py: a loaded model has none of its fast paths until the one step
installs them all; the attention backend's typed FUSED_CPU_OPS decides the C norms, rope and
decode stack. (That each path computes what the torch path does: test_decode_stack.py,
test_quantized.py, test_cpu_linear.py, tests/kernels/test_cpu_ops.py.)"""

from __future__ import annotations

import ast
import importlib.util

import c_build
import pytest
import torch
from tiny_quant_gguf import write_tiny_gguf

from engine.models.accelerate import FastPaths, accelerate
from engine.models.cpu_linear import PackedLinear, onednn_available
from engine.models.llama import RMSNorm
from engine.models.loader import load_model
from ipc.model_source import resolve_model
from kernels.attention import BACKENDS
from kernels.cpu import fused as cpu_fused
from kernels.cpu import quant as cpu_quant

CPU = torch.device("cpu")


def _declared_fused_cpu_ops(module: str) -> list[object]:
    """The values a backend module assigns to FUSED_CPU_OPS at its top level (read from its
    source: the GPU backends do not import here)."""
    path = importlib.util.find_spec(module).origin
    tree = ast.parse(open(path).read())
    return [node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and any(getattr(t, "id", None) == "FUSED_CPU_OPS" for t in node.targets)]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_attention_backend_declares_fused_cpu_ops(name):
    assert _declared_fused_cpu_ops(BACKENDS[name].module) == [name == "cpu"]


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_model_dir, tmp_path_factory):
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("acc") / "q4_1.gguf", "Q4_1")


def _norms(model) -> set[bool]:
    return {m.fused for m in model.modules() if isinstance(m, RMSNorm)}


@pytest.mark.parametrize("fused_cpu_ops", [True, False])
def test_a_quantized_model_gets_every_path_in_the_one_step(q4_1_gguf, fused_cpu_ops):
    c_build.require(None if cpu_fused.available() else cpu_fused.build_error())
    c_build.require_isa("avx512", cpu_quant.isa_supported("avx512"))  # packed tiles need it
    model, cfg = load_model(resolve_model(str(q4_1_gguf)), torch.float32, CPU, "gguf")
    # loaded: the slots are empty (the torch formulas run)
    assert all(layer.mlp.fused is None for layer in model.layers)
    assert model.decode_stack is None and not model.fused_cpu_ops and _norms(model) == {False}
    paths = accelerate(model, cpu_linear="auto", fused_cpu_ops=fused_cpu_ops, device=CPU,
                       dtype=torch.float32)
    assert paths == FastPaths(cpu_linear="torch", fused_mlps=cfg.num_layers,
                              fused_cpu_ops=fused_cpu_ops, decode_stack=fused_cpu_ops)
    assert all(layer.mlp.fused is not None for layer in model.layers)
    assert (model.decode_stack is not None) == fused_cpu_ops
    assert model.fused_cpu_ops == fused_cpu_ops and _norms(model) == {fused_cpu_ops}


def test_a_dense_model_gets_packed_linears_and_no_quantized_paths(tiny_model_dir):
    if not onednn_available():
        pytest.fail("this torch has no oneDNN linear: the packed path cannot be tested")
    model, _ = load_model(resolve_model(str(tiny_model_dir)), torch.float32, CPU)
    paths = accelerate(model, cpu_linear="onednn", fused_cpu_ops=False, device=CPU,
                       dtype=torch.float32)
    assert paths == FastPaths(cpu_linear="onednn", fused_mlps=0, fused_cpu_ops=False,
                              decode_stack=False)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
