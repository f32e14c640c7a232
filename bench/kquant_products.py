"""Batch-1 products per type on Gemma 3 270M's shapes: raw blocks (quant_packed.c's kernels)
against packed tiles (quant_packed.c's for Q4_1, quant_kpacked.c's for the rest), both numerics.

    python -m bench.kquant_products [--threads 1] [--reps 40]

Random blocks with small fp16 scales; the figure is the best of two runs of --reps calls,
raw and packed alternating. NOTE: one thread by default: on the shared 2-core machine the
OpenMP barrier of a two-thread call waits for a descheduled thread and dominates.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import numpy as np
import torch

from kernels.cpu import quant as cpu_quant

SHAPES = [(3, 2048, 640), (6, 2048, 640), (7, 2048, 640), (12, 640, 2048), (13, 640, 2048),
          (14, 640, 2048)]  # (type, N, K): gate/up-like 640 -> 2048, down-like 2048 -> 640
SCALES_AT = {3: [0, 2], 6: [0], 7: [0, 2], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    elems, nbytes = cpu_quant.BLOCKS[type_id]
    b = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in SCALES_AT[type_id]:
        scales = rng.uniform(-0.01, 0.01, size=(n, k // elems)).astype(np.float16)
        b[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
    return torch.from_numpy(b.reshape(n, -1))


def best_ms(f: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.kquant_products", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    res = {}
    for t, n, k in SHAPES:
        raw_blocks = random_blocks(t, n, k, rng)
        packed = cpu_quant.pack(raw_blocks, t, k)
        x, out = torch.randn(1, k), torch.empty(1, n)
        for num in ("a8", "a32"):
            product = cpu_quant.PackedProduct(packed, t, n, k, num)

            raw = partial(cpu_quant.matmul, x, raw_blocks, t, k, num, out=out)
            tiles = partial(product, x, out)
            r1, p1, r2, p2 = (best_ms(f, args.reps) for f in (raw, tiles, raw, tiles))
            ms = min(p1, p2)
            res[f"{cpu_quant.TYPE_NAMES[t]} {k}->{n} {num}"] = {
                "raw_ms": min(r1, r2), "packed_ms": ms, "bytes": raw_blocks.numel(),
                "packed_GB_s": raw_blocks.numel() / ms / 1e6}
    for name, v in res.items():
        print(f"{name:24s} raw {v['raw_ms']:.4f} ms  packed {v['packed_ms']:.4f} ms  "
              f"{v['raw_ms'] / v['packed_ms']:.2f}x  ({v['packed_GB_s']:.1f} GB/s)")
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
