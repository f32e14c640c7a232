"""Single-stream decode in process on the bundled GGUF: the per-layer path against the one-call
decoder stack (engine/models/fused_stack.py), both in the same run, for each numerics.

    python -m bench.decode_stack [--numerics a8,a32] [--rounds 3] [--prompt-len 128]
                                 [--output-len 128] [--rows 1] [--kv-cache-dtype auto]

Each round runs `--rows` greedy requests (`ignore_eos`) to completion once per path, the paths
alternating round by round so drift hits both; a step's time is one `engine.step()` (schedule,
runner, sampling, update), and the figure is the median decode step (the first step, the
prefill, left out) over the rounds. The per-layer path is the model with its decode stack
taken off; the stack's call counter proves the fused path ran. Tokens of both paths are
compared (the driver calls the same kernels, so they must agree).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine import LLM
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams


def _decode_steps(llm: LLM, prompts: list[list[int]], output_len: int,
                  tag: str) -> tuple[list[float], list[list[int]]]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(request_id=f"{tag}-{i}", prompt_token_ids=p,
                                      sampling=params))
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        deltas = engine.step()
        times.append(time.perf_counter() - t0)
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)
    return times[1:], list(tokens.values())


def measure(numerics: str, rounds: int, prompt_len: int, output_len: int, rows: int,
            kv_cache_dtype: str = "auto") -> dict:
    llm = LLM(None, quantization="gguf", quantization_numerics=numerics, kv_cache_space=0.25,
              kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    stack = model.decode_stack
    if stack is None:
        raise SystemExit("the bundled model got no decode stack here (see fused_stack.py)")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(prompt_len)] for _ in range(rows)]
    steps: dict[str, list[float]] = {"per-layer": [], "fused": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = ["per-layer", "fused"] if r % 2 else ["fused", "per-layer"]
        for mode in order:
            model.decode_stack = stack if mode == "fused" else None
            calls = stack.calls
            times, outputs[mode] = _decode_steps(llm, prompts, output_len, f"{mode}{r}")
            ran = stack.calls - calls
            assert ran == (len(times) if mode == "fused" else 0), (mode, ran, len(times))
            if r:
                steps[mode].append(statistics.median(times))
    model.decode_stack = stack
    ms = {m: 1e3 * statistics.median(t) for m, t in steps.items()}
    return {"numerics": numerics, "rows": rows, "per_layer_ms": ms["per-layer"],
            "fused_ms": ms["fused"], "speedup": ms["per-layer"] / ms["fused"],
            "tokens_equal": outputs["fused"] == outputs["per-layer"],
            "rounds_ms": {m: [round(1e3 * t, 3) for t in v] for m, v in steps.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numerics", default="a8,a32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=1, help="concurrent requests (decode rows)")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    print(f"bundled GGUF, {args.rows} row(s), KV {args.kv_cache_dtype}, "
          f"{args.prompt_len}-token prompt, "
          f"{args.output_len} greedy tokens; median ms per decode step over {args.rounds} "
          "rounds")
    for numerics in args.numerics.split(","):
        r = measure(numerics, args.rounds, args.prompt_len, args.output_len, args.rows,
                    args.kv_cache_dtype)
        print(f"{numerics:>4}: per-layer {r['per_layer_ms']:.2f} ms, fused {r['fused_ms']:.2f} "
              f"ms: {r['speedup']:.2f}x; tokens equal: {r['tokens_equal']}; rounds "
              f"{r['rounds_ms']}")


if __name__ == "__main__":
    main()
