"""Batch-1 (or --rows) decode in process on a GGUF file, pagedserve's numerics beside
`llama-bench tg128` on the same file, in one run.

    python -m bench.decode_gguf [--model FILE.gguf] [--modes a32,a8,a8-f16kv,a8-raw]
                                [--rounds 3] [--prompt-len 128] [--output-len 128] [--rows 1]
                                [--llama-bench auto|none|PATH] [--threads 2]

A mode is a numerics (a32, a8), "-f16kv" for a float16 KV cache (else float32), and "-raw" to
load the file with the packed tiles of kernels/cpu/csrc/quant_kpacked.c turned off (the
raw-block kernels of quant_packed.c, as before issue 31), so one run shows both; "-layers"
runs every step layer by layer (the model's one-call decode stack, kernels/cpu/csrc/fused.c,
removed), to show what the stack buys. Each round
runs `--rows` greedy requests (`ignore_eos`) per mode, the modes in turn; the figure is the
median decode step (`engine.step()`, the prefill step left out) over the rounds. llama-bench
(bench/llama_cpp.py's build) runs `-p 0 -n OUTPUT_LEN -t THREADS -r ROUNDS` on the same file.

The floor: the file's weight bytes that one decode step reads (every matrix; the embedding
table once, as the output layer where it is tied, else one row of it), at the memory read rate
measured in the same run (the best of a few sums over 1 GiB with THREADS threads).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

from bench.output import write_json
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams


def decode_steps(llm: object, prompts: list[list[int]], output_len: int, tag: str) -> list[float]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(request_id=f"{tag}-{i}", prompt_token_ids=p,
                                      sampling=params))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def load(model: str, mode: str) -> object:
    """An in-process LLM for a mode; "-raw" loads with cpu_kquant's tiles off, "-layers"
    without the decode stack."""
    from engine import LLM
    from kernels.cpu import kquant as cpu_kquant

    numerics = mode.split("-")[0]
    kv = "float16" if "-f16kv" in mode else "float32"
    packs = cpu_kquant.packs
    if "-raw" in mode:
        cpu_kquant.packs = lambda type_id, k: False  # NOTE: this load only
    try:
        llm = LLM(model, quantization="gguf", quantization_numerics=numerics,
                  kv_cache_space=0.25, kv_cache_dtype=kv)
    finally:
        cpu_kquant.packs = packs
    if "-layers" in mode:
        llm.engine.runner.model.decode_stack = None
    return llm


def weight_bytes(model: str) -> int:
    """The bytes of the file's tensors that one decode step reads."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if name != "token_embd.weight" or tied)


def read_rate(threads: int, tries: int = 5) -> float:
    """Memory read bytes/s: the best of `tries` sums over a 1 GiB float32 tensor."""
    import torch

    torch.set_num_threads(threads)
    big = torch.ones(2**28)
    best = float("inf")
    for _ in range(tries + 1):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.numel() * 4 / best


def llama_bench(binary: str, model: str, n: int, threads: int, rounds: int) -> dict:
    done = subprocess.run([binary, "-m", model, "-p", "0", "-n", str(n), "-t", str(threads),
                           "-r", str(rounds), "-o", "json"], capture_output=True, text=True,
                          check=True)
    row = json.loads(done.stdout)[0]
    return {"tok_s": row["avg_ts"], "ms_per_token": 1e3 / row["avg_ts"],
            "stddev_tok_s": row["stddev_ts"], "cpu_info": row.get("cpu_info"),
            "build": row.get("build_commit")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.decode_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--modes", default="a32,a8,a8-f16kv,a8-raw")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-bench", default="auto",
                   help="auto: bench/llama_cpp.py's no-AMX build if built; none; or a path")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.model is None:
        from ipc.model_source import bundled_gguf

        args.model = str(bundled_gguf())
    modes = [m for m in args.modes.split(",") if m]
    llms = {m: load(args.model, m) for m in modes}
    vocab = min(32000, llms[modes[0]].engine.runner.model.cfg.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.rows)]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds + 1):  # NOTE: round 0 warms up
        for m in (modes if r % 2 else modes[::-1]):
            times = decode_steps(llms[m], prompts, args.output_len, f"{m}{r}")
            if r:
                steps[m].append(statistics.median(times))
    result = {"model": args.model, "rows": args.rows, "threads": args.threads,
              "ms_per_step": {m: 1e3 * statistics.median(v) for m, v in steps.items()},
              "rounds_ms": {m: [round(1e3 * t, 2) for t in v] for m, v in steps.items()}}
    read = read_rate(args.threads)
    nbytes = weight_bytes(args.model)
    result["floor"] = {"weight_bytes": nbytes, "read_GB_s": read / 1e9,
                       "ms_per_token": 1e3 * nbytes / read,
                       "x_floor": {m: v / (1e3 * nbytes / read)
                                   for m, v in result["ms_per_step"].items()}}
    binary = args.llama_bench
    if binary == "auto":
        from bench import llama_cpp

        path = llama_cpp.build_dir(False) / "bin" / "llama-bench"
        binary = str(path) if path.is_file() else "none"
    if binary != "none":
        result["llama_bench"] = llama_bench(binary, args.model, args.output_len, args.threads,
                                            args.rounds)
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
