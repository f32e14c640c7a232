"""`pagedserve serve` spawns its engines before it imports the web stack (gateway/cli.py): if
that import then fails, the engines it spawned are closed, not left to notice their parent's
death on their own: also one whose spawn was still in flight when the import failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ENGINES = """
import asyncio, importlib.machinery, os, socket, sys, threading

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

def serve_until_the_import_fails():
    import gateway.cli
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

CODE = ENGINES + """
sys.modules["gateway.serving"] = None  # NOTE: its import now raises ModuleNotFoundError
serve_until_the_import_fails()
"""

# NOTE: the spawn held open after the fork (as uvloop's is until its waiter resolves), and
# the import failing only then: the cancelled start() must not lose the forked process
IN_FLIGHT = ENGINES + """
forked = threading.Event()
real_exec = asyncio.create_subprocess_exec

async def slow_exec(*args, **kwargs):
    proc = await real_exec(*args, **kwargs)
    forked.set()
    await asyncio.sleep(3)
    return proc

asyncio.create_subprocess_exec = slow_exec

class FailAfterFork:  # NOTE: waits in exec_module: find_spec runs under the global import lock
    def find_spec(self, name, path=None, target=None):
        if name == "gateway.serving":
            return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        assert forked.wait(60), "no engine was forked"
        raise ModuleNotFoundError(module.__name__)

sys.meta_path.insert(0, FailAfterFork())
serve_until_the_import_fails()
"""


def run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_failed_web_stack_import_closes_the_spawned_engines():
    run(CODE)


def test_an_engine_forked_while_the_import_fails_is_closed_too():
    run(IN_FLIGHT)
