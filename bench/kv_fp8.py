"""Accuracy cost of an FP8 (e4m3) KV cache on the bundled model, against an fp32 cache.

Attention-output error on real activations (every layer, prefill and decode, bf16 cache shown
for scale) and greedy agreement over a set of prompts: `python -m bench.kv_fp8`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from engine.llm import LLM
from ipc.sampling import SamplingParams
from kernels.attention import torch_backend

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers greater than 100:",
    "Translate to French: I would like a cup of coffee.",
    "Once upon a time, in a small village by the mountains,",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:",
    "A good name for a pet turtle would be",
    "import numpy as np\n# compute the mean of each row\n",
    "The most important idea in computer science is",
    "Dear team, I am writing to let you know that",
    "Photosynthesis converts",
    "In 1969, the first humans",
    "Here is a recipe for pancakes:",
]
# shadow name -> (cache dtype, per-head scales calibrated as amax / 448 per layer)
SHADOWS = {
    "bf16": (torch.bfloat16, False),
    "fp8_e4m3": (torch.float8_e4m3fn, False),
    "fp8_e4m3 per-head scales": (torch.float8_e4m3fn, True),
}
CALIBRATION_PROMPTS = 4


@dataclass
class ErrorSums:
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    per_call: list[float] = field(default_factory=list)

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        d, r = float((out - ref).pow(2).sum()), float(ref.pow(2).sum())
        self.diff_sq += d
        self.ref_sq += r
        self.per_call.append((d / r) ** 0.5)


class ShadowBackend:
    """The torch backend on the engine's fp32 cache (whose output the model uses), and the same
    calls on bf16 and fp8 copies of every layer's cache, comparing the attention outputs."""

    def __init__(self) -> None:
        self.caches: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.layer_of: dict[int, int] = {}  # cache data_ptr -> layer, in first-use order
        self.amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> [kvh] K, V
        self.calibrating = True  # until calibrated(): record amax, no shadows
        self.errors = {name: ErrorSums() for name in SHADOWS}
        self.kv_absmax = 0.0
        self.kv_tiny = self.kv_count = 0  # |x| < 2**-6: where e4m3 turns subnormal

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        torch_backend.write_kv(key, value, k_cache, v_cache, slot_mapping)
        if self.calibrating:
            layer = self.layer_of.setdefault(k_cache.data_ptr(), len(self.layer_of))
            k_max, v_max = key.abs().amax(dim=(0, 2)), value.abs().amax(dim=(0, 2))
            old = self.amax.get(layer, (k_max, v_max))
            self.amax[layer] = (torch.maximum(old[0], k_max), torch.maximum(old[1], v_max))
            return
        for name, (kc, vc) in self._shadows(k_cache, v_cache).items():
            torch_backend.write_kv(key, value, kc, vc, slot_mapping,
                                   **self._scales(name, k_cache))
        kv = torch.cat([key.flatten(), value.flatten()]).abs()
        self.kv_absmax = max(self.kv_absmax, float(kv.max()))
        self.kv_tiny += int((kv < 2**-6).sum())
        self.kv_count += kv.numel()

    def paged_attention(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        ref = torch_backend.paged_attention(q, k_cache, v_cache, meta, scale)
        if self.calibrating:
            return ref
        for name, (kc, vc) in self._shadows(k_cache, v_cache).items():
            out = torch_backend.paged_attention(q, kc, vc, meta, scale,
                                                **self._scales(name, k_cache))
            self.errors[name].add(out, ref)
        return ref

    def _scales(self, name: str, k_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        if not SHADOWS[name][1]:
            return {}
        k_max, v_max = self.amax[self.layer_of[k_cache.data_ptr()]]
        return {"k_scale": k_max / 448, "v_scale": v_max / 448}

    def _shadows(self, k_cache, v_cache):
        key = k_cache.data_ptr()
        if key not in self.caches:
            self.caches[key] = {name: (torch.zeros_like(k_cache, dtype=dt),
                                       torch.zeros_like(v_cache, dtype=dt))
                                for name, (dt, _) in SHADOWS.items()}
        return self.caches[key]


def greedy(kv_cache_dtype: str, max_tokens: int, shadow: ShadowBackend | None = None):
    # NOTE: no prefix caching: a block cached by the calibration pass would skip the prefill
    # that writes the shadow caches.
    llm = LLM(None, kv_cache_dtype=kv_cache_dtype, attention_backend="torch", num_gpu_blocks=512,
              dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if shadow is not None:
        llm.engine.runner.backend = shadow
        llm.generate(PROMPTS[:CALIBRATION_PROMPTS], params)
        shadow.calibrating = False
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outs], time.perf_counter() - t0


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of sequences identical, mean share of tokens before the first difference)."""
    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), len(x))
        prefix.append(n / len(x))
    return same, sum(prefix) / len(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    shadow = ShadowBackend()
    ref, t_ref = greedy("auto", args.max_tokens, shadow)
    fp8, t_fp8 = greedy("fp8_e4m3", args.max_tokens)
    print(f"bundled model, fp32 weights and activations, {len(PROMPTS)} prompts, "
          f"{args.max_tokens} greedy tokens each; per-head scales: amax / 448 per layer and "
          f"KV head over the first {CALIBRATION_PROMPTS} prompts (a calibration pass)")
    print("attention output vs the fp32 cache, all layers, prefill + decode:")
    for name, e in shadow.errors.items():
        calls = sorted(e.per_call)
        print(f"  {name:25s} relative error {(e.diff_sq / e.ref_sq) ** 0.5:.4%} overall, "
              f"median call {calls[len(calls) // 2]:.4%}, worst call {calls[-1]:.4%}")
    print(f"  K/V values: max |x| {shadow.kv_absmax:.1f} (e4m3 saturates at 448), "
          f"{shadow.kv_tiny / shadow.kv_count:.2%} below 2**-6 (subnormal in e4m3)")
    same, prefix = agreement(ref, fp8)
    print(f"greedy fp8_e4m3 cache vs fp32 cache: {same:.0%} of sequences identical, "
          f"{prefix:.0%} of tokens before the first difference "
          f"(runs {t_ref:.0f}s with shadows, {t_fp8:.0f}s)")


if __name__ == "__main__":
    main()
