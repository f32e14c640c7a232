"""The bundled model's linear layers per decode step: torch vs the prepacked layouts.

Runs every linear product of one forward pass (30 layers' qkv, o, gate_up, down, then the LM
head) at several row counts, the modes interleaved pass by pass in a rotating order so machine
drift hits all alike, and prints the median milliseconds and the speedup over torch (`F.linear`
on the checkpoint layout, the engine's reference). Modes: `onednn` (oneDNN-packed only),
`dense+onednn` (the dense weight up to 3 rows, dual's fallback without MKL's packed GEMM) and
`dual` (MKL-packed up to 64 rows, oneDNN-packed above).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from engine.models.cpu_linear import PackedLinear, mkl_packed_available
from engine.models.loader import load_model
from ipc.model_source import resolve_model


def layer_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    found = [(m.weight, m.bias) for m in model.modules() if type(m) is nn.Linear]
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    return [*found, (head.weight, None)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,3,4,8,16,32,64")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model, _ = load_model(resolve_model(None), torch.float32, torch.device("cpu"))
    weights = layer_weights(model)
    modes = {
        "torch": [_dense(w, b) for w, b in weights],
        "onednn": [PackedLinear(w, b, small=None) for w, b in weights],
        "dense+onednn": [PackedLinear(w, b, small="dense") for w, b in weights],
    }
    if mkl_packed_available():
        modes["dual"] = [PackedLinear(w, b, small="mkl") for w, b in weights]
    print(f"bundled model, {len(weights)} linear products per step, float32, "
          f"{torch.get_num_threads()} threads; median ms of {args.iters} interleaved rounds")
    names = list(modes)
    print(f"{'rows':>5} " + " ".join(f"{m:>12}" for m in names) + "   speedup over torch: "
          + " ".join(names[1:]))
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, max(w.shape[1] for w, _ in weights))
        times = {m: [] for m in modes}
        for i in range(args.iters + 1):
            # NOTE: the order rotates each round: a mode timed right after oneDNN's calls can
            # pay for the thread pool's state they leave (seen at 2 threads)
            k = i % len(names)
            for mode in names[k:] + names[:k]:
                layers = modes[mode]
                t0 = time.perf_counter()
                for layer in layers:
                    layer(x[:, : layer.in_features])
                if i:  # the first round warms up
                    times[mode].append(time.perf_counter() - t0)
        med = {m: sorted(t)[len(t) // 2] * 1e3 for m, t in times.items()}
        print(f"{rows:>5} " + " ".join(f"{med[m]:>12.1f}" for m in names) + "   "
              + " ".join(f"{med['torch'] / med[m]:>6.2f}x" for m in names[1:]))


class _dense(nn.Module):
    """F.linear on the checkpoint layout, as nn.Linear runs it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.in_features = weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


if __name__ == "__main__":
    main()
