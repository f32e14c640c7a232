"""Offline throughput: the in-process engine against static-batching HF `generate`, same workload.

    python -m bench.offline [--distribution fixed|mixed|chat] [--num-requests 32]
                            [--baseline hf-static|none] [--dollars-per-hour 2.5]
                            [--breakdown] [engine flags]

Outputs are fixed by ignore_eos, so both systems do the same work; the baseline runs at each
batch size of `--baseline-batch-sizes` and is quoted at its best. `--breakdown` times the parts
of each engine step (schedule, input preparation, model forward, logits, sampling, update).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from bench.memory import PeakMemory
from bench.output import write_json
from bench.workloads import DISTRIBUTIONS, RequestSpec, make_workload, prompt_token_ids
from ipc.config import add_engine_args, config_from_args
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="fixed")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=None, help="override every prompt length")
    p.add_argument("--output-len", type=int, default=None, help="override every output length")
    p.add_argument("--max-output-len", type=int, default=None,
                   help="clip drawn output lengths (short runs; quote it with the figures)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--baseline", choices=("hf-static", "none"), default="hf-static")
    p.add_argument("--baseline-batch-sizes", default="8,32",
                   help="static batch sizes B to try; the best one is the baseline")
    p.add_argument("--dollars-per-hour", type=float, default=None,
                   help="machine price: adds cost per million output tokens")
    p.add_argument("--breakdown", action="store_true", help="time the parts of each step")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON results here")
    add_engine_args(p)
    return p


def build_workload(args: argparse.Namespace, vocab: int, max_len: int):
    specs = make_workload(args.distribution, args.num_requests, args.workload_seed,
                          args.max_output_len, max_total_len=max_len)
    specs = [RequestSpec(args.prompt_len or s.prompt_len, args.output_len or s.output_len)
             for s in specs]
    rng = random.Random(args.workload_seed + 1)
    return [prompt_token_ids(s, vocab, rng) for s in specs], [s.output_len for s in specs]


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
    states = getattr(core.runner, "states", None)  # NOTE: absent before the step plan (17a)
    if states is not None:  # applying the plan's entries to the runner's rows is input prep
        t.wrap(states, "apply", "prepare inputs")
        t.wrap(states, "set_step_inputs", "prepare inputs")
    t.wrap(core.runner.model, "forward", "model forward")
    t.wrap(core.runner.model, "compute_logits", "logits (lm head)")
    t.wrap(core.runner, "sampler", "sample")
    return t


def run(core, prompts: list[list[int]], output_lens: list[int]) -> dict:
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        core.add_request(AddRequest(request_id=f"bench-{i}", prompt_token_ids=p, sampling=params))
    steps = out_tokens = 0
    while core.has_unfinished_requests():
        out_tokens += sum(len(d.new_token_ids) for d in core.step())
        steps += 1
    elapsed = time.perf_counter() - start
    total = out_tokens + sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "steps": steps, "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / elapsed, "total_tok_per_s": total / elapsed}


def matmul_gflops(m: int, k: int, n: int, seconds: float = 0.3, windows: int = 5) -> float:
    """Measured float32 matrix rate at one of the model's own shapes ([m, k] @ [k, n]): the
    best of a few timing windows, so that a moment of machine noise does not lower the floor."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm-up
    best = 0.0
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            a @ b
            reps += 1
        best = max(best, 2.0 * m * k * n * reps / elapsed / 1e9)
    return best


def run_engine(args: argparse.Namespace, timer_on: bool) -> tuple[dict, StepTimer | None, tuple]:
    # NOTE: --max-num-seqs is the engine's batch width; below --num-requests, finished
    # requests' slots are refilled from the queue (continuous batching).
    config = config_from_args(args)
    from engine.core import EngineCore

    core = EngineCore(config)
    cfg = core.model_config
    prompts, output_lens = build_workload(args, cfg.vocab_size, core.max_model_len)
    warm = prompts[:2]
    run(core, warm, [4] * len(warm))  # warm-up: first-call allocations, thread pools
    timer = instrument(core) if timer_on else None
    with PeakMemory() as mem:
        result = run(core, prompts, output_lens)
    params = core.num_params
    batch = min(args.num_requests, config.max_num_seqs)
    gflops = matmul_gflops(batch, cfg.hidden_size, cfg.intermediate_size)
    result.update(system="pagedserve", peak_rss_bytes=mem.peak_rss, peak_cuda_bytes=mem.peak_cuda,
                  floor={"params": params, "matmul_gflops": gflops, "matmul_m": batch,
                         "compute_floor_tok_per_s": gflops * 1e9 / (2.0 * params)})
    floor = result["floor"]["compute_floor_tok_per_s"]
    result["floor"]["fraction_of_floor"] = result["output_tok_per_s"] / floor
    # NOTE: prompt tokens cost the same FLOPs: counting only output tokens, a workload with
    # prompts as long as its outputs cannot pass half the floor
    result["floor"]["fraction_of_floor_all_tokens"] = result["total_tok_per_s"] / floor
    stats = core.stats()
    result["spec"] = {"draft_tokens": stats.spec_draft_tokens,
                      "accepted_tokens": stats.spec_accepted_tokens,
                      "verify_steps": stats.spec_verify_steps}
    meta = (core.model_name, core.max_model_len, cfg.vocab_size)
    del core
    gc.collect()
    return result, timer, meta


def run_baseline(args: argparse.Namespace, vocab: int, max_len: int) -> list[dict]:
    from bench.hf_baseline import load_model, run_static

    model, tok = load_model(args.model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts, output_lens = build_workload(args, vocab, max_len)
    run_static(model, prompts[:2], [4, 4], 2, pad)  # warm-up, as for the engine
    results = []
    for b in sorted({min(int(x), len(prompts)) for x in args.baseline_batch_sizes.split(",")}):
        with PeakMemory() as mem:
            r = run_static(model, prompts, output_lens, b, pad)
        r.update(system="hf-static", batch_size=b, peak_rss_bytes=mem.peak_rss,
                 peak_cuda_bytes=mem.peak_cuda)
        results.append(r)
    del model
    gc.collect()
    return results


def main(argv: list[str] | None = None) -> None:
    import torch

    args = build_parser().parse_args(argv)
    engine, timer, (model_name, max_len, vocab) = run_engine(args, args.breakdown)
    baselines = run_baseline(args, vocab, max_len) if args.baseline != "none" else []
    best = max(baselines, key=lambda r: r["output_tok_per_s"], default=None)
    for r in [engine, *baselines]:
        if best is not None:
            r["ratio_to_baseline"] = r["output_tok_per_s"] / best["output_tok_per_s"]
        if args.dollars_per_hour is not None:
            r["dollars_per_million_output_tokens"] = (
                args.dollars_per_hour / 3600 / r["output_tok_per_s"] * 1e6)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_avg": os.getloadavg(),
              "num_threads": torch.get_num_threads(),
              "model": model_name, "distribution": args.distribution,
              "num_requests": args.num_requests, "workload_seed": args.workload_seed,
              "max_output_len": args.max_output_len, "pagedserve": engine,
              "baselines": baselines, "best_baseline_batch_size": best and best["batch_size"]}
    write_json(args.out, result, indent=2)
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result, args)
    if timer is not None:
        _print_breakdown(timer.totals, engine["elapsed_s"])


def _print_table(result: dict, args: argparse.Namespace) -> None:
    e = result["pagedserve"]
    print(f"{result['model']}: {args.num_requests} requests, distribution {args.distribution} "
          f"(seed {args.workload_seed}), {e['output_tokens']} output tokens")
    print(f"  {'system':<20} {'out tok/s':>10} {'total tok/s':>12} {'peak RSS':>10} "
          f"{'vs base':>8} {'$/M out':>9}")
    for r in [e, *result["baselines"]]:
        name = r["system"] + (f" B={r['batch_size']}" if "batch_size" in r else "")
        ratio = f"{r['ratio_to_baseline']:.2f}x" if "ratio_to_baseline" in r else "-"
        cost = r.get("dollars_per_million_output_tokens")
        print(f"  {name:<20} {r['output_tok_per_s']:>10.1f} {r['total_tok_per_s']:>12.1f} "
              f"{r['peak_rss_bytes'] / 2**30:>8.2f}Gi {ratio:>8} "
              f"{'-' if cost is None else f'{cost:.2f}':>9}")
    spec = e["spec"]
    if spec["verify_steps"]:
        print(f"  speculative: {spec['draft_tokens']} draft tokens, {spec['accepted_tokens']} "
              f"accepted, {spec['verify_steps']} verify steps")
    f = e["floor"]
    print(f"  compute floor: {f['matmul_gflops']:.0f} GFLOP/s float32 at M={f['matmul_m']}, "
          f"2 x {f['params'] / 1e6:.0f}M params/token -> {f['compute_floor_tok_per_s']:.0f} "
          f"tok/s; pagedserve reaches {100 * f['fraction_of_floor']:.0f}% in output tokens, "
          f"{100 * f['fraction_of_floor_all_tokens']:.0f}% in all tokens processed")


def _print_breakdown(totals: dict[str, float], elapsed: float) -> None:
    print("  step breakdown (share of wall time):")
    for name, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<18} {secs:8.3f} s  {100 * secs / elapsed:5.1f}%")
    overhead = sum(totals.get(k, 0.0) for k in ("schedule", "prepare inputs", "sample", "update"))
    print(f"    {'overhead total':<18} {overhead:8.3f} s  {100 * overhead / elapsed:5.1f}%"
          "  (schedule + prepare + sample + update)")


if __name__ == "__main__":
    main()
