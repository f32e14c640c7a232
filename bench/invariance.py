"""Does a request's output depend on what else the engine does? Each scenario runs the same
greedy requests under one change (prefix cache warm, smaller prefill chunks, batch mates, other
thread counts) and compares every step's full logits, bit for bit, with the requests run alone
and cold.

    python -m bench.invariance [--model PATH] [--modes a8-f16kv,a32-f32kv] [--prompts 3]
                               [--prompt-words 300] [--max-tokens 16] [--out FILE.json]

Prints, per mode and scenario, how many requests had bit-identical logits at every step, the
largest absolute logit difference, and whether the greedy tokens still agreed.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.output import write_json
from engine import LLM
from ipc.sampling import SamplingParams

MODES = {  # name -> (quantization_numerics, kv_cache_dtype)
    "a8-f16kv": ("a8", "float16"),
    "a32-f32kv": ("a32", "float32"),
}
WORDS = ("the of and to in is was for on that with as by at from his her it an are were be "
         "this which river city people music light winter garden letter").split()


@dataclass
class Run:
    """Per request (in submission order): its greedy tokens and each step's logits [vocab]."""

    tokens: list[list[int]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)


def capture(llm: LLM, prompts: list[str], max_tokens: int) -> Run:
    """Generate `prompts` greedily in one call (`ignore_eos`), keeping the raw logits the
    sampler saw at each of their steps. NOTE: a step that verifies drafts samples through
    `Sampler.verify`, so a speculating request records only its plain steps."""
    seen: dict[str, list[torch.Tensor]] = {}
    cls = type(llm.engine.runner.sampler)
    original = cls.__call__

    def recording(self, logits, rows):  # NOTE: the raw logits, before any sampling rule
        for i, row in enumerate(rows):
            seen.setdefault(row.key, []).append(logits[i].detach().clone())
        return original(self, logits, rows)

    cls.__call__ = recording  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        cls.__call__ = original  # type: ignore[method-assign]
    run = Run()
    for out in outs:
        run.tokens.append(out.outputs[0].token_ids)
        run.logits.append(seen[out.request_id])
    return run


def compare(ref: Run, other: Run) -> dict:
    identical, max_diff, same_tokens = 0, 0.0, 0
    for a_steps, b_steps, a_tok, b_tok in zip(ref.logits, other.logits, ref.tokens,
                                              other.tokens, strict=True):
        same_tokens += a_tok == b_tok
        steps = min(len(a_steps), len(b_steps))
        bits = all(torch.equal(a, b) for a, b in zip(a_steps[:steps], b_steps[:steps],
                                                        strict=True))
        identical += bits and a_tok == b_tok
        # NOTE: the logits are comparable only while the tokens agree
        agree = next((i for i, (x, y) in enumerate(zip(a_tok, b_tok, strict=False)) if x != y),
                     steps)
        for a, b in zip(a_steps[: agree + 1], b_steps[: agree + 1], strict=False):
            max_diff = max(max_diff, float((a - b).abs().max()))
    return {"identical": identical, "of": len(ref.tokens), "same_tokens": same_tokens,
            "max_abs_logit_diff": max_diff}


def scenarios(model: str | None, numerics: str, kv: str, prompts: list[str], mates: list[str],
              max_tokens: int) -> dict[str, dict]:
    def make(**over) -> LLM:
        return LLM(model, quantization_numerics=numerics, kv_cache_dtype=kv, **over)

    def alone(llm: LLM) -> Run:
        runs = [capture(llm, [p], max_tokens) for p in prompts]
        return Run([r.tokens[0] for r in runs], [r.logits[0] for r in runs])

    base = make()
    ref = alone(base)
    # name -> (the run, how many of its first requests are `prompts`: batch mates follow them)
    cases: dict[str, tuple[Callable[[], Run], int]] = {
        "prefix cache warm": (lambda: alone(base), len(prompts)),  # the same engine: cached
        "batch mates (first row)": (lambda: capture(base, prompts[:1] + mates, max_tokens), 1),
        "batch mates (all rows)": (lambda: capture(make(), prompts + mates[:4], max_tokens),
                                   len(prompts)),
        "prefill chunks of 64": (lambda: alone(make(max_num_batched_tokens=64)), len(prompts)),
        "1 thread": (lambda: alone(make(num_threads=1)), len(prompts)),
    }
    results = {}
    for name, (fn, n) in cases.items():
        run = fn()
        results[name] = compare(Run(ref.tokens[:n], ref.logits[:n]),
                                Run(run.tokens[:n], run.logits[:n]))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model path (default: the bundled GGUF)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            for _ in range(args.prompts + 6)]
    prompts, mates = text[: args.prompts], text[args.prompts:]
    report = {}
    for mode in args.modes.split(","):
        numerics, kv = MODES[mode]
        report[mode] = scenarios(args.model, numerics, kv, prompts, mates, args.max_tokens)
        for name, r in report[mode].items():
            print(f"{mode:10} {name:24} bit-identical {r['identical']}/{r['of']}  "
                  f"same tokens {r['same_tokens']}/{r['of']}  "
                  f"max |dlogit| {r['max_abs_logit_diff']:.3g}", flush=True)
    if args.out:
        write_json(args.out, {"argv": argv, "results": report})


if __name__ == "__main__":
    main()
