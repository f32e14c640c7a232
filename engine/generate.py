"""`pagedserve generate "..."`: answer prompts in-process (the bundled model by default)."""

from __future__ import annotations

import argparse
import sys

from ipc.config import add_engine_args, config_from_args
from ipc.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve generate", description=__doc__)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p)
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engine.llm import LLM

    llm = LLM(**vars(config))
    if args.raw:
        outputs = llm.generate(args.prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f">>> {prompt}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
