"""Running decodes while a long prompt prefills, in process (issue 31, item 5).

    python -m bench.long_prefill [--model FILE.gguf] [--streams 8] [--long-len 4096]
                                 [--configs "default;max_num_batched_tokens=256"] [--rounds 2]

`--streams` greedy requests (128-token prompts, `ignore_eos`) decode; once every one of them
has its first token and a few steps are timed alone, one `--long-len`-token prompt arrives.
Each engine step gives every running stream one token, so a step's wall time is the
inter-token latency each of them sees (the gateway adds the same small cost to every token).
Reported per config: ITL p50 of the streams alone, ITL p50/p99/max while the long prompt
prefills (from its arrival to its first token), that prompt's time to first token, and its
prefill rate. A config is `;`-separated; each is `default` or comma-separated EngineConfig
fields (`name=value`). The configs alternate round by round, so machine drift hits all alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench.metrics import percentile
from bench.output import write_json
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams

ALONE_STEPS = 8


def parse_config(text: str) -> dict[str, object]:
    if text.strip() == "default":
        return {}
    out: dict[str, object] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def one_round(llm, streams: int, long_len: int, vocab: int, tag: str, rng: random.Random) -> dict:
    engine = llm.engine
    decode = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - 128,
                            ignore_eos=True)
    for i in range(streams):
        prompt = [rng.randrange(100, vocab) for _ in range(128)]
        engine.add_request(AddRequest(request_id=f"{tag}-s{i}", prompt_token_ids=prompt,
                                      sampling=decode))
    started: set[str] = set()
    while len(started) < streams:
        started.update(d.request_id for d in engine.step() if d.new_token_ids)
    alone = []
    for _ in range(ALONE_STEPS):
        t0 = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - t0)
    long_id = f"{tag}-long"
    prompt = [rng.randrange(100, vocab) for _ in range(long_len)]
    arrived = time.perf_counter()
    engine.add_request(AddRequest(request_id=long_id, prompt_token_ids=prompt,
                                  sampling=SamplingParams(temperature=0.0, max_tokens=1)))
    during = []
    while True:
        t0 = time.perf_counter()
        deltas = engine.step()
        during.append(time.perf_counter() - t0)
        if any(d.request_id == long_id and d.new_token_ids for d in deltas):
            break
    ttft = time.perf_counter() - arrived
    engine.abort_requests([f"{tag}-s{i}" for i in range(streams)])
    while engine.has_unfinished_requests():
        engine.step()
    return {"alone": alone, "during": during, "ttft": ttft}


def summary(rounds: list[dict], long_len: int) -> dict:
    alone = [t for r in rounds for t in r["alone"]]
    during = [t for r in rounds for t in r["during"]]
    ttft = statistics.median(r["ttft"] for r in rounds)
    return {"itl_alone_p50_ms": 1e3 * statistics.median(alone),
            "itl_during_p50_ms": 1e3 * statistics.median(during),
            "itl_during_p99_ms": 1e3 * percentile(during, 99),
            "itl_during_max_ms": 1e3 * max(during),
            "steps_during": statistics.median(len(r["during"]) for r in rounds),
            "long_ttft_s": ttft, "long_prefill_tok_s": long_len / ttft}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.long_prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=".gguf file (default: the bundled model)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--configs", default="default")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from engine import LLM

    torch.set_num_threads(args.threads)
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    llms = {c: LLM(args.model, max_model_len=args.long_len + 64, **parse_config(c))
            for c in configs}
    vocab = min(32000, next(iter(llms.values())).engine.runner.model.cfg.vocab_size)
    rng = random.Random(0)
    one_round(llms[configs[0]], 2, min(256, args.long_len), vocab, "warm", rng)  # NOTE: warm-up
    rounds: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            rounds[c].append(one_round(llms[c], args.streams, args.long_len, vocab,
                                       f"r{r}", rng))
    result = {"model": args.model or "bundled", "streams": args.streams,
              "long_len": args.long_len, "threads": args.threads,
              "configs": {c: summary(v, args.long_len) for c, v in rounds.items()}}
    for c, s in result["configs"].items():
        print(f"{c}: ITL alone p50 {s['itl_alone_p50_ms']:.1f} ms; while the long prompt "
              f"prefills p50 {s['itl_during_p50_ms']:.1f} p99 {s['itl_during_p99_ms']:.1f} "
              f"max {s['itl_during_max_ms']:.1f} ms over {s['steps_during']:.0f} steps; its "
              f"TTFT {s['long_ttft_s']:.2f} s ({s['long_prefill_tok_s']:.0f} tok/s)")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
