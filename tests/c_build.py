"""The C kernels' tests fail where `make setup` provides a C compiler (x86-64 Linux) and the
build fails anyway; elsewhere they skip. A broken build must never turn the production CPU
path into a green run of skips. The same holds for a SIMD path the CPU has (`require_isa`)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

REQUIRED = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def require(error: str | None) -> None:
    """Fail (x86-64 Linux) or skip (elsewhere) the calling test when the build gave `error`."""
    if error is None:
        return
    if REQUIRED:
        pytest.fail(f"the C kernels must build on x86-64 Linux (`make setup` installs gcc): "
                    f"{error}", pytrace=False)
    pytest.skip(f"C kernels not built here: {error}")


# NOTE: /proc/cpuinfo's names for what kernels/cpu/csrc/quant.c's isa_supported asks the CPU for
CPUINFO_FLAGS = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"},
                 "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                            "avx512dq", "avx512_vnni"}}


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags as the kernel reports them (Linux), else None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def require_isa(isa: str, supported: bool) -> None:
    """Skip a test of a SIMD path only when the CPU really lacks it: where /proc/cpuinfo lists
    every flag the path needs (or, on x86-64 Linux, cannot be read) and the library says it is
    unsupported, fail. On CI's AVX-512 machine neither skip here nor `require`'s can fire."""
    if supported:
        return
    flags = cpu_flags()
    if flags is None and REQUIRED:  # NOTE: no proof the CPU lacks it: no silent skip either
        pytest.fail(f"the C library says {isa} is unsupported and /proc/cpuinfo gives no "
                    "flags to confirm it", pytrace=False)
    if flags is not None and CPUINFO_FLAGS[isa] <= flags:
        pytest.fail(f"/proc/cpuinfo has every flag {isa} needs ({sorted(CPUINFO_FLAGS[isa])}) "
                    "but the C library says it is unsupported", pytrace=False)
    pytest.skip(f"this CPU has no {isa}")
