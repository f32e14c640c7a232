"""KV memory benchmarks: utilization and concurrency of the paged allocator against a naive
allocator that reserves max_model_len slots per request, and TTFT with a shared system prompt,
prefix cache warm against off, and the blocks a long sliding-window request holds with and
without window freeing.

    python -m bench.kv_memory [--num-requests 200] [--budget-tokens 32768] [--ttft-runs 5]
                              [--window 4096] [--window-tokens 16384]

Utilization and concurrency run the real Scheduler and KVCacheManager on the mixed workload
(outputs of 16 to 2,000 tokens) with sampling replaced by a fixed token: the allocator's
behaviour does not depend on which tokens come out. The naive allocator is the same scheduler
with one block of max_model_len tokens per request, i.e. a whole context reserved up front.
TTFT runs the bundled model in-process. Window freeing runs one long request through the real
Scheduler and KVCacheManager with the window (every layer windowed, as Mistral) and without
(what a model with any global layer, such as Gemma 2/3, must keep), same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench.workloads import make_workload
from engine.sched.kv_manager import KVCacheManager
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.step_plan import RunnerOutput, Sampled, StepPlan
from ipc.sampling import SamplingParams


def _tokens(plan: StepPlan) -> RunnerOutput:
    """A stand-in runner's answer: token 7 for every sampling choice."""
    return RunnerOutput({r.key: Sampled(7, [], None) for r in plan.sampling})


def simulate(specs, block_size: int, budget_tokens: int, max_model_len: int) -> dict:
    """Run the scheduler to completion; return token-weighted utilization and concurrency."""
    kv = KVCacheManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(1024, 8192, max_model_len), kv, eos_token_ids=[])
    rng = random.Random(0)
    for i, s in enumerate(specs):
        params = SamplingParams(max_tokens=s.output_len, ignore_eos=True)
        prompt = [rng.randrange(100, 40000) for _ in range(s.prompt_len)]
        sched.add(Request(str(i), prompt, params, max_tokens=s.output_len, arrival_time=i))
    stored = allocated = steps = 0
    running: list[int] = []
    saturated: list[int] = []  # running counts while requests still wait for room
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, _tokens(out))
        used = kv.pool.num_blocks - kv.num_free_blocks
        stored += sum(r.num_computed_tokens for r in sched.running)
        allocated += used * block_size
        running.append(len(sched.running))
        if sched.num_waiting:
            saturated.append(len(sched.running))
        steps += 1
    return {"utilization": stored / allocated, "mean_running": statistics.mean(running),
            "mean_running_saturated": statistics.mean(saturated),
            "peak_running": max(running), "steps": steps,
            "preemptions": sched.num_preemptions}


def window_freeing(window: int, total_tokens: int, block_size: int = 16,
                   chunk: int = 512, prompt_len: int = 1024) -> dict:
    """Peak and final KV blocks held by one request of total_tokens (prompt_len prompt, the
    rest generated), with blocks behind the window released and without."""
    result = {}
    for label, w in (("freeing", window), ("no_freeing", None)):
        kv = KVCacheManager(-(-total_tokens // block_size) + 1, block_size,
                            enable_prefix_caching=False, window=w)
        sched = Scheduler(SchedulerConfig(8, chunk, total_tokens + 1), kv, eos_token_ids=[])
        out_len = total_tokens - prompt_len
        params = SamplingParams(max_tokens=out_len, ignore_eos=True)
        sched.add(Request("long", [7] * prompt_len, params, max_tokens=out_len))
        peak = 0
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update(out, _tokens(out))
            peak = max(peak, kv.pool.num_blocks - kv.num_free_blocks)
        assert kv.num_free_blocks == kv.pool.num_blocks  # KV blocks balance
        result[label] = {"peak_blocks": peak, "bound": kv.max_blocks_held(total_tokens, chunk)}
    result["ratio"] = result["no_freeing"]["peak_blocks"] / result["freeing"]["peak_blocks"]
    return result


# NOTE: Mistral-7B's KV shape (32 layers, 8 KV heads of 128, bf16): bytes of one 16-token block
MISTRAL_7B_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 16


def ttft(runs: int, prefix_len: int) -> dict:
    from engine.core import EngineCore
    from ipc.config import EngineConfig
    from ipc.messages import AddRequest

    rng = random.Random(1)
    system = [rng.randrange(100, 40000) for _ in range(prefix_len)]
    params = SamplingParams(temperature=0, max_tokens=1)
    results = {}
    for label, caching in (("cache_off", False), ("cache_warm", True)):
        core = EngineCore(EngineConfig(enable_prefix_caching=caching, max_model_len=2048))
        core.add_request(AddRequest(request_id="warm", prompt_token_ids=system + [5],
                                    sampling=params))
        while core.has_unfinished_requests():
            core.step()
        times = []
        for i in range(runs):
            prompt = system + [rng.randrange(100, 40000) for _ in range(20)]
            start = time.perf_counter()
            core.add_request(AddRequest(request_id=f"{label}-{i}", prompt_token_ids=prompt,
                                        sampling=params))
            while not any(d.new_token_ids for d in core.step()):
                pass
            times.append(time.perf_counter() - start)
        results[label] = statistics.median(times)
        del core
    results["speedup"] = results["cache_off"] / results["cache_warm"]
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--budget-tokens", type=int, default=32768, help="KV slots in both systems")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ttft-runs", type=int, default=5, help="0 skips the TTFT part")
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--window", type=int, default=4096, help="sliding window (Mistral's)")
    p.add_argument("--window-tokens", type=int, default=16384,
                   help="length of the long windowed request (0 skips the part)")
    args = p.parse_args(argv)
    specs = make_workload("mixed", args.num_requests, seed=0,
                          max_total_len=args.max_model_len)
    paged = simulate(specs, args.block_size, args.budget_tokens, args.max_model_len)
    naive = simulate(specs, args.max_model_len, args.budget_tokens, args.max_model_len)
    report = {"paged": paged, "naive": naive,
              "concurrency_ratio": paged["mean_running_saturated"]
              / naive["mean_running_saturated"]}
    print(f"mixed workload, {args.num_requests} requests, KV budget {args.budget_tokens} tokens")
    for name, r in (("paged", paged), ("naive", naive)):
        print(f"  {name:5}: utilization {100 * r['utilization']:5.1f}%  running while a queue "
              f"waits {r['mean_running_saturated']:6.1f} (mean over all steps "
              f"{r['mean_running']:.1f}, peak {r['peak_running']})  "
              f"steps {r['steps']}  preemptions {r['preemptions']}")
    print(f"  requests held at once under load, same budget: {report['concurrency_ratio']:.1f}x "
          "the naive allocator's")
    if args.window_tokens:
        w = report["window"] = window_freeing(args.window, args.window_tokens, args.block_size)
        mib = MISTRAL_7B_BLOCK_BYTES / 2**20
        print(f"one request of {args.window_tokens} tokens, window {args.window} on every layer:"
              f" peak KV blocks {w['freeing']['peak_blocks']} with window freeing (bound "
              f"{w['freeing']['bound']}), {w['no_freeing']['peak_blocks']} without: "
              f"{w['ratio']:.1f}x fewer ({w['freeing']['peak_blocks'] * mib:.0f} MiB against "
              f"{w['no_freeing']['peak_blocks'] * mib:.0f} MiB at Mistral-7B's KV shape)")
    if args.ttft_runs:
        report["ttft"] = ttft(args.ttft_runs, args.prefix_len)
        t = report["ttft"]
        print(f"TTFT with a {args.prefix_len}-token shared system prompt (median of "
              f"{args.ttft_runs}): cache off {1000 * t['cache_off']:.0f} ms, warm "
              f"{1000 * t['cache_warm']:.0f} ms: {t['speedup']:.1f}x lower")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
