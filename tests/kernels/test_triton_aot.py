"""Ahead-of-time compile of every production Triton kernel configuration for Hopper (sm_90),
no GPU needed: a cubin is built, nothing spills, shared memory fits."""

from __future__ import annotations

import os

import pytest

# NOTE: triton is a test dependency: a missing install fails here instead of skipping.
assert os.environ.get("TRITON_INTERPRET") != "1", (
    "TRITON_INTERPRET=1 replaces kernels by interpreted ones: unset it to compile for sm_90")
import triton  # noqa: E402

from kernels.attention import triton_aot  # noqa: E402

GPU_TRITON = "3.6.0"  # what the lent H200 machine has


def test_triton_version_matches_the_gpu_machine():
    assert triton.__version__ == GPU_TRITON


@pytest.mark.parametrize("spec", triton_aot.production_specs(), ids=lambda s: s.name)
def test_compiles_for_hopper(spec):
    compiled = triton_aot.compile_spec(spec)
    assert compiled.asm["cubin"], "no cubin"
    res = triton_aot.resources(compiled)
    assert res.spill_bytes == 0, f"{spec.name} spills: {res}"
    assert res.shared_bytes <= triton_aot.HOPPER_SMEM_BYTES, f"{spec.name}: {res}"
    assert res.registers <= 255
