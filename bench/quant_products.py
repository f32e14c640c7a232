"""Quantized products beside torch's float32 GEMM, by row count (kernels/cpu/quant.py).

    python -m bench.quant_products [--rows 1,8,64,256,1024,2048] [--threads N]

For SmolLM2-135M's matrix shapes (random weights quantized by the `gguf` package), the best of
several calls, in ms, of: the packed a8 kernel, the packed a32 kernel, the same Q4_1/Q8_0
weights expanded to float32 tile by tile and multiplied by torch's GEMM (a32's path past
quant_linear.PREFILL_ROWS), and F.linear on the dequantized float32 weights (the float32
model's product). Ratios are against F.linear in the same run.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.quant_linear import QuantLinear, QuantWeight
from kernels.cpu import quant as cpu_quant

SHAPES = [(3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (960, 576, "Q4_1"), (49152, 576, "Q8_0")]


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64,256,1024,2048")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print("| matrix | rows | packed a8 | packed a32 | expand + GEMM | float32 F.linear "
          "| a8 vs float32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, k, type_name in SHAPES:
        type_id = int(GGMLQuantizationType[type_name])
        w = torch.randn(n, k, generator=gen) * 0.05
        blocks = torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), type_id)))
        raw = QuantWeight(blocks, type_id, n, k)
        packed = raw.pack()
        dense = raw.rows_f32()
        expand = QuantLinear([raw], None, "a32")
        for m in [int(r) for r in args.rows.split(",")]:
            if n > 10000 and m > 64:
                continue  # NOTE: the head multiplies one row per sequence, not prefill chunks
            x = torch.randn(m, k, generator=gen)
            reps = 15 if m <= 64 else 5
            packed_ms = [best_ms(partial(cpu_quant.packed_matmul, x, packed.data, type_id, n,
                                         k, numerics), reps) for numerics in ("a8", "a32")]
            a8, a32 = packed_ms
            exp = best_ms(partial(expand, x), reps) if m > 64 else float("nan")
            f32 = best_ms(partial(F.linear, x, dense), reps)
            print(f"| {k} -> {n} {type_name} | {m} | {a8:.3f} | {a32:.3f} | {exp:.3f} | "
                  f"{f32:.3f} | {f32 / a8:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
