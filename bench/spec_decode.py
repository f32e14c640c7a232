"""Speculative decoding at batch 1: tokens/s with and without it, on an input-grounded task
(rewrite a given passage, where n-gram lookup shines) and on open chat, per proposer and
gamma, with acceptance rate and mean accepted length. Baseline and speculation run in the
same invocation on the same machine.

    python -m bench.spec_decode [--max-tokens 96] [--gammas 2 4 8] [--methods ngram self]
                                [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ipc.sampling import SamplingParams

PASSAGE = (
    "The paged KV cache stores the keys and values of every request in fixed blocks of "
    "sixteen tokens. A block table maps each request's positions to blocks, so memory is "
    "taken only as a sequence grows and given back the moment it finishes. Requests that "
    "share a prompt prefix share its blocks through reference counts."
)
TASKS = {
    "grounded": [{"role": "user", "content": "Repeat the following passage word for word:\n\n"
                  + PASSAGE}],
    "chat": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
}


def run(llm, messages, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4))  # warm
    start = time.perf_counter()
    out = llm.chat(messages, params)[0]
    return time.perf_counter() - start, len(out.token_ids)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--methods", nargs="+", default=["ngram", "self"])
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from engine.llm import LLM

    configs = [(None, 0)] + [(m, g) for m in args.methods for g in args.gammas]
    engines = {}
    for method, gamma in configs:
        options = {} if method is None else {"speculative_method": method,
                                             "num_speculative_tokens": gamma,
                                             "speculative_draft_layers": args.draft_layers}
        engines[(method, gamma)] = LLM(max_model_len=1024, num_gpu_blocks=256, **options)
    # NOTE: rounds interleave every configuration, and each figure is a median over rounds,
    # so a change in the machine's load hits all configurations alike.
    samples: dict[tuple, list[float]] = {}
    counts: dict[tuple, list[int]] = {}
    for _ in range(args.rounds):
        for key, llm in engines.items():
            for task, messages in TASKS.items():
                before = llm.engine.stats()
                seconds, tokens = run(llm, messages, args.max_tokens)
                after = llm.engine.stats()
                samples.setdefault((*key, task), []).append(tokens / seconds)
                c = counts.setdefault((*key, task), [0, 0, 0])
                c[0] += after.spec_draft_tokens - before.spec_draft_tokens
                c[1] += after.spec_accepted_tokens - before.spec_accepted_tokens
                c[2] += after.spec_verify_steps - before.spec_verify_steps
    rows = []
    for (method, gamma, task), values in samples.items():
        tps = statistics.median(values)
        base = statistics.median(samples[(None, 0, task)])
        drafts, accepted, verifies = counts[(method, gamma, task)]
        rows.append({"method": method or "none", "gamma": gamma, "task": task,
                     "tok_per_s": tps, "speedup": tps / base,
                     "acceptance": accepted / drafts if drafts else None,
                     "mean_accepted": accepted / verifies if verifies else None})
    print(f"{'method':7} {'gamma':>5} {'task':9} {'tok/s':>7} {'vs none':>8} "
          f"{'accept':>7} {'mean acc':>8}")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        mean = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        print(f"{r['method']:7} {r['gamma']:>5} {r['task']:9} {r['tok_per_s']:7.1f} "
              f"{r['speedup']:7.2f}x {acc:>7} {mean:>8}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
