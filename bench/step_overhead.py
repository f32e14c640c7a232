"""Scheduler cost per step without a model: schedule() and update() over a stand-in runner
that samples one fixed token, on bench.offline's fixed workload (32 requests, 128/64 tokens).

    python -m bench.step_overhead [--baseline-tree /path/to/other/checkout] [--repeats 5]

With --baseline-tree the same measurement runs in a subprocess on that checkout's code (one
that predates the step plan is driven through its SamplerOutput), and the ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def _answer(plan):
    if not hasattr(plan, "num_scheduled_tokens"):  # NOTE: a tree from before the step plan
        from engine.sampler import SamplerOutput  # type: ignore[import-not-found]

        return SamplerOutput([7] * len(plan.sampling), [None] * len(plan.sampling))
    from engine.step_plan import RunnerOutput, Sampled

    return RunnerOutput({r.key: Sampled(7, [], None) for r in plan.sampling})


def measure(num_requests: int = 32, prompt_len: int = 128, output_len: int = 64) -> dict:
    """One run to completion: total schedule and update seconds and the step count."""
    try:
        from engine.sched.kv_manager import KVCacheManager
        from engine.sched.request import Request
        from engine.sched.scheduler import Scheduler, SchedulerConfig
    except ImportError:  # NOTE: a tree from before engine/sched (issue 26)
        from engine.kv_manager import KVCacheManager  # type: ignore[no-redef]
        from engine.request import Request  # type: ignore[no-redef]
        from engine.scheduler import Scheduler, SchedulerConfig  # type: ignore[no-redef]
    from ipc.sampling import SamplingParams

    kv = KVCacheManager(4096, 16, True, 0)
    sched = Scheduler(SchedulerConfig(128, 2048, 2048), kv, [0])
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        sched.add(Request(str(i), prompt, params, output_len))
    schedule = update = 0.0
    steps = 0
    while sched.has_unfinished():
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        answer = _answer(plan)
        t2 = time.perf_counter()
        sched.update(plan, answer)
        update += time.perf_counter() - t2
        schedule += t1 - t0
        steps += 1
    return {"schedule_s": schedule, "update_s": update, "steps": steps}


def best_of(repeats: int) -> dict:
    runs = [measure() for _ in range(repeats)]
    return min(runs, key=lambda r: r["schedule_s"] + r["update_s"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ours = best_of(args.repeats)
    if args.json:
        print(json.dumps(ours))
        return
    rows = [("this tree", ours)]
    if args.baseline_tree is not None:
        env = {**os.environ, "PYTHONPATH": str(args.baseline_tree)}
        # NOTE: this file, run by path, imports the other tree's engine (PYTHONPATH first)
        out = subprocess.run([sys.executable, __file__, "--json", "--repeats",
                              str(args.repeats)], cwd=args.baseline_tree, env=env,
                             check=True, capture_output=True, text=True).stdout
        rows.append(("baseline tree", json.loads(out.splitlines()[-1])))
    for name, r in rows:
        per = (r["schedule_s"] + r["update_s"]) / r["steps"] * 1e6
        print(f"  {name:<14} schedule {r['schedule_s'] * 1e3:6.2f} ms  update "
              f"{r['update_s'] * 1e3:6.2f} ms  over {r['steps']} steps: {per:6.1f} us/step")
    if len(rows) == 2:
        a, b = (r["schedule_s"] + r["update_s"] for _, r in rows)
        print(f"  ratio (this / baseline): {a / b:.2f}")


if __name__ == "__main__":
    main()
