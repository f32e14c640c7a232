"""A broken C build fails the C kernels' tests on x86-64 Linux instead of skipping them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import c_build
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not c_build.REQUIRED, reason="the C build is optional off x86-64 Linux")
@pytest.mark.parametrize("test", [
    "tests/kernels/test_cpu_ops.py::test_rope_falls_back_where_the_kernel_does_not_fit",
    "tests/kernels/test_cpu_backend.py::test_cpu_write_kv_skips_padding",
    "tests/kernels/test_cpu_quant.py::test_dequantize_rows_gathers_gguf_rows[scalar]",
])
def test_a_failing_compiler_fails_the_tests(tmp_path, test):
    env = {**os.environ, "CC": "false", "PAGEDSERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the C kernels must build on x86-64 Linux" in done.stdout


def outcome(isa: str, supported: bool) -> str:
    """What require_isa does, caught here: a skip inside the test would otherwise turn the
    test itself into a skip instead of a failure."""
    try:
        c_build.require_isa(isa, supported=supported)
    except pytest.fail.Exception as e:
        return f"fail: {e}"
    except pytest.skip.Exception:
        return "skip"
    return "pass"


@pytest.mark.skipif(c_build.cpu_flags() is None, reason="no /proc/cpuinfo")
def test_a_simd_path_the_cpu_has_cannot_be_skipped() -> None:
    flags = c_build.cpu_flags()
    for isa, needs in c_build.CPUINFO_FLAGS.items():
        if needs <= flags:  # type: ignore[operator]
            assert outcome(isa, supported=False).startswith("fail: /proc/cpuinfo has every")
        else:
            assert outcome(isa, supported=False) == "skip"
        assert outcome(isa, supported=True) == "pass"


@pytest.mark.skipif(not c_build.REQUIRED, reason="the C build is optional off x86-64 Linux")
def test_unreadable_cpu_flags_fail_instead_of_skipping(monkeypatch) -> None:
    monkeypatch.setattr(c_build, "cpu_flags", lambda: None)
    result = outcome("avx512", supported=False)
    assert result.startswith("fail:") and "no flags to confirm" in result, result
