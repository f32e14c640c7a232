"""`pagedserve serve` refuses a flag value it cannot honour before it starts anything: exit 2
naming the flag, never a silent change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_exits_2_naming_the_flag(port: str) -> None:
    # NOTE: the socket layer takes a port modulo 65536: 99999 would listen on 34463
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", port],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--port" in r.stderr and port in r.stderr
