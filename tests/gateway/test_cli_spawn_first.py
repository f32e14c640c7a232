"""`pagedserve serve` spawns its engines before it imports the web stack (gateway/cli.py): if
that import then fails, the engines it spawned are closed, not left to notice their parent's
death on their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import os, socket, sys
sys.modules["gateway.serving"] = None  # NOTE: its import now raises ModuleNotFoundError
import gateway.cli

def engines():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if b"engine" in argv and b"--parent-pid" in argv and str(os.getpid()).encode() in argv:
            found.append(pid)
    return found

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
try:
    gateway.cli.main(["serve", "--port", str(port)])
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the failed import did not reach the caller")
assert not engines(), f"engines left running: {engines()}"
"""


def test_a_failed_web_stack_import_closes_the_spawned_engines():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
