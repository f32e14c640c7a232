"""A swapped-out request comes back with its blocks, also under `python -O` (no model needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.sched.kv_manager import KVCacheManager
from engine.sched.preemption import SWAP, PreemptionCost
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.step_plan import CopyKind, RunnerOutput, Sampled
from ipc.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def swap_round_trip() -> tuple[int, list[int], int]:
    """Two requests in a pool too small for both: the newer one is swapped out, then back in.
    Returns (swap-ins, its block table after the swap-in, its computed tokens then)."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False,
                        num_cpu_blocks=4)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv, [],
                      PreemptionCost(1, 1e12, "cpu", SWAP))
    params = SamplingParams(max_tokens=8, temperature=0)
    old = Request("old", list(range(7)), params, 8, arrival_time=1.0)
    new = Request("new", list(range(7)), params, 8, arrival_time=2.0)
    sched.add(old)
    sched.add(new)
    for _ in range(20):
        out = sched.schedule()
        if out.empty:
            break
        sched.update(out, RunnerOutput({r.key: Sampled(5, [], None) for r in out.sampling}))
        if any(c.kind == CopyKind.CPU_TO_GPU for c in out.block_copies):
            break
    return sched.preemptions.swap_in_blocks, kv.block_ids(new.key), new.num_computed_tokens


def test_swap_in_restores_blocks() -> None:
    swap_ins, blocks, computed = swap_round_trip()
    assert swap_ins > 0
    assert len(blocks) * 4 >= computed > 0


def test_swap_in_restores_blocks_under_python_O() -> None:
    code = ("import sys; sys.path.insert(0, 'tests/engine'); "
            "from test_scheduler_swap import swap_round_trip as f; print(f())")
    result = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    swap_ins, blocks, computed = eval(result.stdout.strip())
    assert swap_ins > 0 and len(blocks) * 4 >= computed > 0
