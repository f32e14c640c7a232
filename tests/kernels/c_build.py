"""The C kernels' tests fail where `make setup` provides a C compiler (x86-64 Linux) and the
build fails anyway; elsewhere they skip. A broken build must never turn the production CPU
path into a green run of skips."""

from __future__ import annotations

import platform
import sys

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
