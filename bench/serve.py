"""Online serving benchmark: the same streamed load against a server and, optionally, the baseline.

    python -m bench.serve --url http://127.0.0.1:8000 [--request-rates 0.5,1,2]
                          [--concurrency 1,4,16] [--baseline hf-static] [--out-dir bench/plots]

Writes serve_results.json and PNG plots under --out-dir. `--baseline hf-static` starts
bench/hf_static_server.py (static batching over HF transformers) and runs the same load on it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from bench import plots
from bench.loadgen import (
    Target,
    client_session,
    first_model,
    make_prompt,
    run_client,
    run_concurrency,
    run_poisson,
)
from bench.metrics import SLO, summarize
from bench.procs import stop, wait_health
from bench.workloads import DISTRIBUTIONS, RequestSpec, make_workload

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of an OpenAI-compatible server")
    p.add_argument("--label", default="pagedserve", help="name of that server in the results")
    p.add_argument("--api", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=None, help="model name to request (default: the first)")
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="fixed")
    p.add_argument("--num-requests", type=int, default=32, help="most requests per load point")
    p.add_argument("--max-prompt-len", type=int, default=None, help="clip prompt lengths")
    p.add_argument("--max-output-len", type=int, default=None, help="clip output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rates", default="", help="Poisson rates in req/s, e.g. 0.5,1,inf")
    p.add_argument("--concurrency", default="", help="closed-loop concurrencies, e.g. 1,4,16")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of sending per point")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="after sending stops, seconds to wait for requests still running")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT below (s)")
    p.add_argument("--slo-itl", type=float, default=0.2, help="goodput SLO: TPOT below (s)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--baseline", choices=("hf-static", "none"), default="none")
    p.add_argument("--baseline-model", default=None, help="model for the baseline server "
                   "(HF directory or .gguf; default: the bundled model)")
    p.add_argument("--baseline-batch-size", type=int, default=8)
    p.add_argument("--baseline-num-threads", type=int, default=None,
                   help="torch threads of the baseline server (match the server under test)")
    p.add_argument("--baseline-url", default=None,
                   help="use an hf-static server already running there instead of starting one")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "plots")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_jobs(args: argparse.Namespace) -> list[tuple[str, RequestSpec]]:
    specs = make_workload(args.distribution, args.num_requests, args.seed, args.max_output_len)
    rng = random.Random(args.seed + 1)
    jobs = []
    for s in specs:
        prompt_len = min(s.prompt_len, args.max_prompt_len or s.prompt_len)
        spec = RequestSpec(prompt_len, s.output_len)
        jobs.append((make_prompt(prompt_len, rng), spec))
    return jobs


async def sweep(args: argparse.Namespace, base_url: str, label: str) -> dict:
    """Every load point against one server, in order: rates, then concurrencies."""
    async with client_session() as client:
        model = args.model or await first_model(client, base_url)
        target = Target(base_url, model, args.api, args.ignore_eos)
        jobs = build_jobs(args)
        slo = SLO(args.slo_ttft, args.slo_itl)
        out: dict = {"model": model, "rate": [], "concurrency": []}
        for rate in _floats(args.request_rates):
            with _bar(args, f"{label} rate {rate:g}/s") as tick:
                recs, secs = await run_poisson(client, target, jobs, rate, args.duration,
                                               args.drain_timeout, args.seed, tick)
            out["rate"].append({"request_rate": rate, **summarize(recs, secs, slo)})
        for conc in _floats(args.concurrency):
            with _bar(args, f"{label} concurrency {int(conc)}") as tick:
                recs, secs = await run_concurrency(client, target, jobs, int(conc), args.duration,
                                                   args.drain_timeout, tick)
            out["concurrency"].append({"concurrency": int(conc), **summarize(recs, secs, slo)})
        return out


@contextmanager
def _bar(args: argparse.Namespace, desc: str):
    bar = tqdm(total=args.num_requests, desc=desc, unit="req", disable=not args.progress,
               file=sys.stderr, leave=True)
    try:
        yield lambda: bar.update(1)
    finally:
        bar.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def baseline_server(model: str | None, batch_size: int, startup_timeout: float = 600.0,
                    num_threads: int | None = None):
    """Start bench/hf_static_server.py on a free loopback port; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.hf_static_server", "--port", str(port),
           "--batch-size", str(batch_size)] + (["--model", model] if model else [])
    cmd += ["--num-threads", str(num_threads)] if num_threads else []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, startup_timeout, "baseline server", poll_s=0.5)
        yield url
    finally:
        stop(proc)


def ratios(ours: dict, base: dict) -> dict:
    """Baseline over ours for latencies (higher is better for us), ours over baseline for rates."""
    out: dict = {"rate": [], "concurrency": []}
    for kind, key in (("rate", "request_rate"), ("concurrency", "concurrency")):
        theirs = {p[key]: p for p in base[kind]}
        for p in ours[kind]:
            b = theirs.get(p[key])
            if b is None:
                continue
            out[kind].append({key: p[key],
                              "ttft_p50": _div(b["ttft_s"]["p50"], p["ttft_s"]["p50"]),
                              "ttft_p99": _div(b["ttft_s"]["p99"], p["ttft_s"]["p99"]),
                              "itl_p50": _div(b["itl_s"]["p50"], p["itl_s"]["p50"]),
                              "output_tokens_per_s": _div(p["output_tokens_per_s"],
                                                          b["output_tokens_per_s"]),
                              "goodput": _div(p["goodput_requests_per_s"],
                                              b["goodput_requests_per_s"])})
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if not (args.request_rates or args.concurrency):
        raise SystemExit("give --request-rates and/or --concurrency")
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": "python -m bench.serve " + " ".join(argv or sys.argv[1:]),
            "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
            "distribution": args.distribution, "num_requests": args.num_requests,
            "seed": args.seed, "max_prompt_len": args.max_prompt_len,
            "max_output_len": args.max_output_len, "api": args.api,
            "baseline_batch_size": args.baseline_batch_size if args.baseline != "none" else None}
    systems = {args.label: run_client(sweep(args, args.url.rstrip("/"), args.label))}
    if args.baseline == "hf-static" and args.baseline_url:
        systems["hf-static"] = run_client(sweep(args, args.baseline_url.rstrip("/"), "hf-static"))
    elif args.baseline == "hf-static":
        with baseline_server(args.baseline_model, args.baseline_batch_size,
                             num_threads=args.baseline_num_threads) as url:
            systems["hf-static"] = run_client(sweep(args, url, "hf-static"))
    meta["load_avg_after"] = os.getloadavg()
    result = {"meta": meta, "systems": systems}
    if "hf-static" in systems:
        result["ratios_vs_hf_static"] = ratios(systems[args.label], systems["hf-static"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "serve_results.json").write_text(json.dumps(result, indent=2))
    out = args.out_dir
    made = [plots.latency_vs_rate(systems, out / "latency_vs_rate.png"),
            plots.throughput_vs_concurrency(systems, out / "throughput_vs_concurrency.png")]
    result["files"] = [str(args.out_dir / "serve_results.json")] + [str(p) for p in made if p]
    _print_summary(result)
    return result


def _print_summary(result: dict) -> None:
    for name, s in result["systems"].items():
        for kind, key in (("rate", "request_rate"), ("concurrency", "concurrency")):
            for p in s[kind]:
                print(f"{name:<12} {kind} {p[key]:<6g} ok {p['num_ok']}/{p['num_requests']} "
                      f"out tok/s {p['output_tokens_per_s']:7.1f}  req/s "
                      f"{p['requests_per_s']:5.2f}  goodput {p['goodput_requests_per_s']:5.2f}  "
                      f"TTFT p50/p99 {_fmt(p['ttft_s']['p50'])}/{_fmt(p['ttft_s']['p99'])}  "
                      f"ITL p50 {_fmt(p['itl_s']['p50'])}  errors {p['errors'] or '-'}")
    print("wrote", ", ".join(result["files"]))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
