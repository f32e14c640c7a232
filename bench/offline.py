"""Offline throughput of the in-process engine on a fixed, seeded workload.

    python -m bench.offline [--num-requests 32] [--prompt-len 128] [--output-len 128]
                            [--breakdown] [engine flags]

Outputs are fixed by ignore_eos, so every run does the same work. `--breakdown` times the parts
of each engine step (schedule, input preparation, model forward, logits, sampling, update).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from contextlib import contextmanager

from ipc.config import add_engine_args, config_from_args
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true", help="time the parts of each step")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    add_engine_args(p)
    return p


def workload(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]


class StepTimer:
    """Wraps the engine's step phases with perf_counter timers (bench only, not in the engine)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, timed)


def instrument(core) -> StepTimer:
    t = StepTimer()
    t.wrap(core.scheduler, "schedule", "schedule")
    t.wrap(core.scheduler, "update", "update")
    t.wrap(core.runner, "_prepare", "prepare inputs")
    t.wrap(core.runner.model, "forward", "model forward")
    t.wrap(core.runner.model, "compute_logits", "logits (lm head)")
    t.wrap(core.runner, "sampler", "sample")
    return t


def run(core, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(request_id=f"bench-{i}", prompt_token_ids=p, sampling=params))
    steps = out_tokens = 0
    while core.has_unfinished_requests():
        out_tokens += sum(len(d.new_token_ids) for d in core.step())
        steps += 1
    elapsed = time.perf_counter() - start
    total = out_tokens + sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "steps": steps, "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / elapsed, "total_tok_per_s": total / elapsed}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args).replace(
        max_num_seqs=max(args.num_requests, config_from_args(args).max_num_seqs))
    from engine.core import EngineCore

    core = EngineCore(config)
    prompts = workload(args.num_requests, args.prompt_len, core.model_config.vocab_size,
                       args.workload_seed)
    run(core, prompts[:2], 4)  # warm-up: first-call allocations, thread pools
    timer = instrument(core) if args.breakdown else None
    result = run(core, prompts, args.output_len)
    result.update(model=core.model_name, num_requests=args.num_requests,
                  prompt_len=args.prompt_len, output_len=args.output_len)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{core.model_name}: {args.num_requests} requests x {args.prompt_len} prompt + "
              f"{args.output_len} output tokens, {result['steps']} steps, "
              f"{result['elapsed_s']:.2f} s")
        print(f"  output tokens/s: {result['output_tok_per_s']:.1f}   "
              f"total tokens/s: {result['total_tok_per_s']:.1f}")
    if timer is not None:
        _print_breakdown(timer.totals, result["elapsed_s"])


def _print_breakdown(totals: dict[str, float], elapsed: float) -> None:
    print("  step breakdown (share of wall time):")
    for name, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<18} {secs:8.3f} s  {100 * secs / elapsed:5.1f}%")
    overhead = sum(totals.get(k, 0.0) for k in ("schedule", "prepare inputs", "sample", "update"))
    print(f"    {'overhead total':<18} {overhead:8.3f} s  {100 * overhead / elapsed:5.1f}%"
          "  (schedule + prepare + sample + update)")


if __name__ == "__main__":
    main()
