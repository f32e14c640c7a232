"""Side by side: pagedserve (quantized and float32) and peer servers on one workload, one at a time.

    python -m bench.peers [--model FILE.gguf] [--concurrency 1,8,64] [--servers quantized,float32,
                          llama.cpp] [--llama-cpp-python /work/peers-venv/bin/python]
                          [--n-ctx 4096] [--kv-match] [--url NAME=http://host:port ...]
                          [--out bench/results/peers.json]

Each server is started (or, for --url, taken as running), timed from start to its first 200 on
/v1/models (time to ready), then every concurrency runs the same completions (a 128-word prompt,
128 output tokens, greedy, streamed) through bench/loadgen.py; the resident memory of the
server's process tree and of its engine process (pagedserve's `-m engine` child; llama.cpp's
server is one process) is read at ready and sampled throughout (peaks reported), and each
point reports the CPU milliseconds per output token of every server process (gateway, engine)
and of the client, from /proc and getrusage, to show where the cores go. For the memory
comparison, `--kv-match` gives pagedserve's KV pool llama.cpp's context (`--n-ctx` tokens) in
float16, as llama.cpp stores its cache by default, and no swap space (which would hold more KV).
llama.cpp's server (llama-cpp-python, in its own venv) is started with `--interrupt_requests
False` (otherwise a new request silently cuts the running one short) and kept from stopping
early by a logit_bias on the end-of-text token, since it has no `ignore_eos`. Ratios are
against llama.cpp and against float32 pagedserve from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench import llama_cpp
from bench.loadgen import (
    Target,
    client_session,
    first_model,
    make_prompt,
    run_client,
    run_concurrency,
)
from bench.metrics import SLO, summarize
from bench.serve import free_port
from bench.workloads import RequestSpec

ROOT = Path(__file__).resolve().parents[1]
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int, read: Callable[[int], Any]) -> dict[str, Any]:
    """read(p) for a process and each of its descendants, by "pid command line"."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            found[f"{p} {cmd}"] = read(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def process_rss(pid: int) -> dict[str, int]:
    """Resident bytes of a process and each of its descendants, by command line."""
    return _process_tree(pid, lambda p: int(Path(f"/proc/{p}/statm").read_text().split()[1])
                         * _PAGE)


def _cpu_seconds(p: int) -> float:
    """User + system CPU seconds of process p, all its threads (not its children's)."""
    fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process and each of its descendants, by command line."""
    return _process_tree(pid, _cpu_seconds)


def client_cpu() -> float:
    """CPU seconds so far of this process: the load generator (and the RSS sampler)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def cpu_per_token(before: dict[str, float], after: dict[str, float], client: float,
                  tokens: int) -> dict[str, float]:
    """CPU ms per output token of each server process alive at both reads, and the client's."""
    if not tokens:
        return {}
    per = {k: 1e3 * (after[k] - before[k]) / tokens for k in before if k in after}
    return {**per, "client": 1e3 * client / tokens}


def _short(label: str) -> str:
    """"engine", "gateway" or the program's name, for a process's "pid command" label."""
    if " -m engine " in label:
        return "engine"
    if " -m gateway" in label:
        return "gateway"
    return "client" if label == "client" else Path(label.split()[1]).name


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    return sum(process_rss(pid).values())


def engine_rss(by_process: dict[str, int]) -> int:
    """The engine process's resident bytes (pagedserve's `-m engine` child), else the tree's
    (llama.cpp's server is one process)."""
    engines = [v for k, v in by_process.items() if " -m engine " in k]
    return engines[0] if engines else sum(by_process.values())


class RssSampler:
    """Peaks of the process tree's RSS (`peak`) and of its engine process's (`engine_peak`)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval, self.peak, self.engine_peak = pid, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        by_process = process_rss(self.pid)
        self.peak = max(self.peak, sum(by_process.values()))
        self.engine_peak = max(self.engine_peak, engine_rss(by_process))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


F16KV = "-f16kv"


LLAMA_SERVER = "llama-server"  # llama.cpp's own C++ server, built by bench/llama_cpp.py


def llama_server_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    """llama.cpp's C++ server as a user runs it: `--slots` parallel sequences with continuous
    batching, each slot `--slot-ctx` tokens of context (`-c` is their sum unless
    `--kv-unified`, where all slots share `-c`), float16 KV (its default)."""
    binary = args.llama_server or str(llama_cpp.binary("llama-server", args.llama_server_amx))
    ctx = args.n_ctx if args.kv_unified else args.slots * args.slot_ctx
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t",
            str(args.threads), "-tb", str(args.threads), "-np", str(args.slots), "-c", str(ctx),
            "--cont-batching", "--no-webui", *(["--kv-unified"] if args.kv_unified else [])]


def server_command(kind: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    if kind == LLAMA_SERVER:
        return llama_server_command(model, port, args)
    if kind == "llama.cpp":
        return [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
                "--n_ctx", str(args.n_ctx), "--interrupt_requests", "False"]
    # NOTE: a "-f16kv" kind is the same server over a float16 KV cache (llama.cpp's default)
    base, f16kv = kind.removesuffix(F16KV), kind.endswith(F16KV)
    # NOTE: "quantized" is the defaults: a8 and a float16 KV cache since 2026-12-03
    # (engine/models/numerics.py); a32 was the default before, now "quantized-a32"
    quant = {"quantized": ["--quantization", "gguf"],
             "quantized-a32": ["--quantization", "gguf", "--quantization-numerics", "a32"],
             "quantized-a8": ["--quantization", "gguf", "--quantization-numerics", "a8"],
             "float32": ["--quantization", "none"]}[base]
    if f16kv:
        quant += ["--kv-cache-dtype", "float16"]
    return [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--num-threads", str(args.threads), *quant,
            *(kv_match_args(args.n_ctx) if args.kv_match else []), *args.pagedserve_args.split()]


def kv_match_args(n_ctx: int, block_size: int = 16) -> list[str]:
    """pagedserve flags for llama.cpp's KV capacity: n_ctx tokens in float16, and no swap
    space (on the CPU a swapped-out block is one more block in host memory: preempted
    requests recompute instead)."""
    return ["--num-gpu-blocks", str(-(-n_ctx // block_size)), "--block-size", str(block_size),
            "--kv-cache-dtype", "float16", "--swap-space", "0"]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            # NOTE: pagedserve lists its model (and /health says ok) once the engine is up
            models = httpx.get(f"{url}/v1/models", timeout=2)
            health = httpx.get(f"{url}/health", timeout=2).status_code
            if models.status_code == 200 and models.json().get("data") and health in (200, 404):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} never became ready")


async def run_points(url: str, kind: str, args: argparse.Namespace,
                     pid: int | None = None) -> list[dict]:
    """Every concurrency's point; with the server's pid, also the CPU each of its processes
    and the client spent per output token (`cpu_ms_per_output_token`)."""
    async with client_session() as client:
        model = await first_model(client, url)
        extra = (("logit_bias", {str(args.eos_token_id): -100}),) if kind == "llama.cpp" else ()
        target = Target(url, model, "completions", kind != "llama.cpp", extra_body=extra)
        spec = RequestSpec(args.prompt_len, args.output_len)
        import random

        rng = random.Random(args.seed)
        points = []
        warm = [(make_prompt(args.prompt_len, rng), RequestSpec(args.prompt_len, 8))]
        await run_concurrency(client, target, warm, 1, 60, 60, lambda: None)
        for conc in args.concurrency:
            n = max(conc, args.min_requests)
            jobs = [(make_prompt(args.prompt_len, rng), spec) for _ in range(n)]
            cpu0, own0 = process_cpu(pid) if pid else {}, client_cpu()
            recs, secs = await run_concurrency(client, target, jobs, conc, args.duration,
                                               args.drain_timeout, lambda: None)
            cpu1, own1 = process_cpu(pid) if pid else {}, client_cpu()
            points.append({"concurrency": conc, **summarize(recs, secs, SLO(1e9, 1e9))})
            p = points[-1]
            p["cpu_ms_per_output_token"] = cpu_per_token(cpu0, cpu1, own1 - own0,
                                                         p["output_tokens"])
            itl = (p["itl_s"] or {}).get("p50")
            cpu = ", ".join(f"{_short(k)} {v:.2f}"
                            for k, v in p["cpu_ms_per_output_token"].items())
            print(f"  {kind} c={conc}: {p['output_tokens_per_s']:.1f} tok/s, ITL p50 "
                  f"{itl * 1e3 if itl else float('nan'):.1f} ms, "
                  f"ok {p['num_ok']}/{p['num_requests']} {p['errors'] or ''}; CPU ms per "
                  f"token: {cpu}", flush=True)
        return points


def bench_server(kind: str, args: argparse.Namespace, url: str | None = None) -> dict:
    proc = None
    start = time.monotonic()
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(server_command(kind, args.model, port, args), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        wait_ready(url, proc, args.startup_timeout)
        ready = time.monotonic() - start
        by_process = process_rss(proc.pid) if proc else {}
        with RssSampler(proc.pid if proc else os.getpid()) as rss:
            points = run_client(run_points(url, kind, args, proc.pid if proc else None))
            rss.sample()  # NOTE: the end of the last point too, whatever the interval
        return {"server": kind, "url": url, "time_to_ready_s": ready if proc else None,
                "rss_ready_bytes": sum(by_process.values()) if proc else None,
                "rss_peak_bytes": rss.peak if proc else None,
                "rss_ready_by_process": by_process,
                "engine_rss_ready_bytes": engine_rss(by_process) if proc else None,
                "engine_rss_peak_bytes": rss.engine_peak if proc else None,
                "points": points}
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def ratio_table(results: list[dict]) -> list[str]:
    """Ratios against llama.cpp's C++ server where the run has it, else llama-cpp-python's."""
    by = {r["server"]: r for r in results}
    name = LLAMA_SERVER if LLAMA_SERVER in by else "llama.cpp"
    lines = [f"| server | conc | out tok/s | ITL p50 ms | vs {name} | vs float32 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for p in r["points"]:
            row = [r["server"], str(p["concurrency"]), f"{p['output_tokens_per_s']:.1f}",
                   f"{p['itl_s']['p50'] * 1e3:.1f}" if (p["itl_s"] or {}).get("p50") else "-"]
            for base in (name, "float32"):
                q = next((b for b in by.get(base, {}).get("points", [])
                          if b["concurrency"] == p["concurrency"]), None)
                row.append(f"{p['output_tokens_per_s'] / q['output_tokens_per_s']:.2f}x tok/s"
                           if q and q["output_tokens_per_s"] else "-")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| server | time to ready s | RSS ready MiB (all processes) | engine RSS "
              "ready MiB | RSS peak MiB | engine RSS peak MiB | engine vs llama.cpp (ready / "
              "peak) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines[-2] = lines[-2].replace("vs llama.cpp", f"vs {name}")
    peer = by.get(name, {})
    for r in results:
        mib = [f"{v / 2**20:.0f}" if v else "-" for v in (
            r["rss_ready_bytes"], r.get("engine_rss_ready_bytes"), r["rss_peak_bytes"],
            r.get("engine_rss_peak_bytes"))]
        ready = f"{r['time_to_ready_s']:.1f}" if r["time_to_ready_s"] else "-"
        vs = " / ".join(f"{r[k] / peer[k]:.2f}x" if r.get(k) and peer.get(k) else "-"
                        for k in ("engine_rss_ready_bytes", "engine_rss_peak_bytes"))
        lines.append(f"| {r['server']} | {ready} | {' | '.join(mib)} | {vs} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf file (default: the bundled model)")
    p.add_argument("--servers", default="quantized,float32,llama.cpp",
                   help="comma list of quantized (the defaults: a8 numerics, float16 KV), "
                        "quantized-a32 (the exact numerics, float32 KV), quantized-a8, "
                        "float32, llama.cpp (llama-cpp-python), llama-server (llama.cpp's "
                        "C++ server); a pagedserve kind + \"-f16kv\": over a float16 KV cache")
    p.add_argument("--url", action="append", default=[],
                   help="NAME=URL of a server already running (not started, no RSS)")
    p.add_argument("--llama-cpp-python", default="/work/peers-venv/bin/python",
                   help="python of the venv with llama-cpp-python[server]")
    p.add_argument("--n-ctx", type=int, default=4096,
                   help="llama.cpp's context (its KV cache) in tokens")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: bench/llama_cpp.py's build)")
    p.add_argument("--llama-server-amx", action="store_true",
                   help="bench/llama_cpp.py's native (AMX) build instead of the no-AMX one")
    p.add_argument("--slots", type=int, default=64, help="llama-server's parallel slots")
    p.add_argument("--slot-ctx", type=int, default=512, help="llama-server's context per slot")
    p.add_argument("--kv-unified", action="store_true",
                   help="llama-server's slots share one --n-ctx cache")
    p.add_argument("--kv-match", action="store_true",
                   help="pagedserve's KV pool = llama.cpp's context, float16 (memory comparison)")
    p.add_argument("--pagedserve-args", default="",
                   help="more flags for pagedserve's servers, e.g. '--kv-cache-space 0.25'")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--eos-token-id", type=int, default=2)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    args = p.parse_args(argv)
    if args.model is None:
        from ipc.model_source import bundled_gguf

        args.model = str(bundled_gguf())
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    results: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # NOTE: after every server, so a run cut short keeps what it measured
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1))

    for kind in [s for s in args.servers.split(",") if s]:
        print(f"{kind}: starting", flush=True)
        results.append(bench_server(kind, args))
        save()
    for item in args.url:
        name, _, url = item.partition("=")
        results.append(bench_server(name, args, url))
        save()
    print("\n".join(ratio_table(results)))
    return results


if __name__ == "__main__":
    main()
