"""Paged attention timings against baselines measured in the same run.

CPU (default): the torch and cpu backends' paged decode against SDPA over a contiguous cache.
GPU (`--device cuda`): decode and prefill per backend; decode bandwidth against a
device-to-device copy, prefill TFLOP/s against a bf16 matrix product.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, get_backend

PAGE = 16


def paged_batch(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int,
                head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: str):
    """Random q and a filled paged cache with scattered blocks; decodes (q_len 1) first."""
    need = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks - 1) + 1  # block 0: the padding block
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    start = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device).to(kv_dtype)
    v_cache = torch.randn(shape, device=device).to(kv_dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, device=device, dtype=dtype)
    nd = sum(1 for n in q_lens if n == 1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
        num_decodes=nd, query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens),
        max_decode_seq_len=max(seq_lens[:nd], default=0),
    )
    return q, k_cache, v_cache, meta


def timed(fn: Callable[[], object], device: str, iters: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---- CPU: paged vs contiguous decode -----------------------------------------------------------

def cpu_decode(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
               iters: int) -> dict[str, float]:
    """Median seconds per call of each CPU backend's paged decode and of the contiguous SDPA."""
    q, k_cache, v_cache, meta = paged_batch([1] * batch, [context] * batch, heads, kv_heads,
                                            head_dim, torch.float32, torch.float32, "cpu")
    scale = 1 / math.sqrt(head_dim)
    # the baseline: the same K/V already contiguous per sequence, one 4-D SDPA (GQA as rows)
    k = torch.randn(batch, kv_heads, context, head_dim)
    v = torch.randn(batch, kv_heads, context, head_dim)
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    fns = {"contiguous": lambda: F.scaled_dot_product_attention(qg, k, v, scale=scale)}
    for name in ("torch", "cpu"):
        try:
            mod = get_backend(name)
        except ValueError as e:
            print(f"skip {name}: {e}")
            continue
        fns[name] = lambda mod=mod: mod.paged_attention(q, k_cache, v_cache, meta, scale)
        if name == "cpu":  # the same cache in float16 (--kv-cache-dtype float16)
            fns["cpu-f16"] = functools.partial(mod.paged_attention, q, k_cache.half(),
                                               v_cache.half(), meta, scale)
    return timed_all(fns, iters)


def timed_all(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median seconds of each CPU function, calls interleaved so load drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:  # warmup
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def run_cpu(args: argparse.Namespace) -> None:
    # SmolLM2-135M's attention shape: 9 query heads, 3 KV heads, head dim 64
    print("paged decode vs SDPA over a contiguous cache (fp32, 9/3 heads, d 64, "
          f"{torch.get_num_threads()} threads); ms, and ratio to contiguous")
    print(f"{'batch':>6} {'context':>8} {'contig':>8} {'torch':>8} {'cpu':>8} {'cpu-f16':>8} "
          f"{'torch/contig':>13} {'cpu/contig':>11} {'cpu/cpu-f16':>12}")
    for batch, context in ((1, 512), (1, 4096), (8, 1024), (32, 512), (64, 256)):
        t = cpu_decode(batch, context, 9, 3, 64, args.iters)
        dense = t["contiguous"]
        cells = [f"{t.get(n, math.nan) * 1e3:>8.3f}"
                 for n in ("contiguous", "torch", "cpu", "cpu-f16")]
        print(f"{batch:>6} {context:>8} {' '.join(cells)} "
              f"{t.get('torch', math.nan) / dense:>13.2f} {t.get('cpu', math.nan) / dense:>11.2f}"
              f" {t.get('cpu', math.nan) / t.get('cpu-f16', math.nan):>12.2f}")


# ---- GPU: per backend, against copy bandwidth and matmul rate ----------------------------------

def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), "cuda", 10)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / timed(lambda: a @ b, "cuda", 10)


def gpu_backends(names: list[str]) -> dict[str, object]:
    found = {}
    for name in names:
        try:
            found[name] = get_backend(name, "cuda")
        except ValueError as e:
            print(f"skip {name}: {e}")
    return found


def time_attention(mod, inputs: tuple, scale: float, iters: int) -> float:
    q, k_cache, v_cache, meta = inputs
    return timed(lambda: mod.paged_attention(q, k_cache, v_cache, meta, scale), "cuda", iters)


def run_gpu(args: argparse.Namespace) -> None:
    heads, kv_heads, d = 32, 8, 128  # Llama-3-8B's attention shape
    bw, mm = copy_bandwidth(), matmul_rate()
    print(f"baselines: d2d copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    backends = gpu_backends(args.backends.split(","))
    scale = 1 / math.sqrt(d)
    print(f"\ndecode (bf16, {heads}/{kv_heads} heads, d {d}): ms, GB/s, % of copy")
    for batch, context in ((1, 4096), (1, 32768), (16, 4096), (64, 1024), (64, 4096),
                           (64, 16384)):
        for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            inputs = paged_batch([1] * batch, [context] * batch, heads, kv_heads, d,
                                 torch.bfloat16, kv_dtype, "cuda")
            kv_bytes = 2 * batch * context * kv_heads * d * kv_dtype.itemsize
            for name, mod in backends.items():
                if kv_name == "fp8" and name != "triton":
                    continue
                if name == "torch" and batch * context > 64 * 4096:
                    continue  # NOTE: the gather copies the whole cache: too slow to matter
                t = time_attention(mod, inputs, scale, 10)
                print(f"  {name:10s} kv {kv_name} batch {batch:3d} ctx {context:6d}: "
                      f"{t * 1e3:8.3f} ms {kv_bytes / t / 1e9:7.0f} GB/s "
                      f"{100 * kv_bytes / t / bw:5.1f}%")
    print(f"\nprefill (bf16, causal, {heads}/{kv_heads} heads, d {d}): ms, TFLOP/s, % of matmul")
    for seqs in ([1024], [8192], [2048] * 4):
        inputs = paged_batch(seqs, seqs, heads, kv_heads, d, torch.bfloat16, torch.bfloat16,
                             "cuda")
        flops = sum(4 * heads * d * n * (n + 1) / 2 for n in seqs)
        for name, mod in backends.items():
            if name == "torch" and max(seqs) > 4096:
                continue  # NOTE: an explicit L x L mask: seconds, not a useful number
            t = time_attention(mod, inputs, scale, 5)
            print(f"  {name:10s} seqs {len(seqs)}x{seqs[0]:5d}: {t * 1e3:8.3f} ms "
                  f"{flops / t / 1e12:6.1f} TFLOP/s {100 * flops / t / mm:5.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backends", default="torch,triton,flash_attn")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.device == "cuda":
        run_gpu(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
