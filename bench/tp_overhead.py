"""Tensor-parallel overhead on this machine: median decode step time at TP=1 and TP=N, same
batch, same model, measured in one run (the ratio is the figure to quote).

    python -m bench.tp_overhead [--tp 2] [--batch 1,8] [--steps 30] [engine flags]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ipc.config import add_engine_args, config_from_args
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams


def step_times(config, batch: int, steps: int) -> list[float]:
    from engine.core import EngineCore

    core = EngineCore(config)
    try:
        for i in range(batch):
            core.add_request(AddRequest(
                request_id=f"r{i}", prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(32)],
                sampling=SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)))
        core.step()  # prefill
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        return times
    finally:
        from engine.parallel.driver import TensorParallelRunner

        if isinstance(core.runner, TensorParallelRunner):
            core.runner.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tp_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--steps", type=int, default=30)
    add_engine_args(p)
    args = p.parse_args()
    base = config_from_args(args)
    for batch in (int(b) for b in args.batch.split(",")):
        medians = {}
        for tp in (1, args.tp):
            times = step_times(base.replace(tensor_parallel_size=tp), batch, args.steps)
            medians[tp] = statistics.median(times)
        print(f"batch {batch}: TP=1 {medians[1] * 1e3:.1f} ms/step, TP={args.tp} "
              f"{medians[args.tp] * 1e3:.1f} ms/step, ratio {medians[args.tp] / medians[1]:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
