"""Seeded benchmark workloads: (prompt length, output length) pairs from a named distribution.

fixed: every request 128/128. mixed: short (16-96) and long (256-2,000) outputs interleaved.
chat: pairs drawn from `chat_lengths.csv`, a table of chat-like lengths kept in the repo.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTIONS = ("fixed", "mixed", "chat")
CHAT_TABLE = Path(__file__).with_name("chat_lengths.csv")

FIXED_LEN = 128
MIXED_PROMPT = (32, 512)
MIXED_SHORT = (16, 96)
MIXED_LONG = (256, 2000)


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    output_len: int


def make_workload(name: str, n: int, seed: int = 0, max_output_len: int | None = None,
                  max_total_len: int | None = None) -> list[RequestSpec]:
    """`n` requests from distribution `name`; the same seed always gives the same list.

    `max_output_len` clips output lengths (for short runs on slow machines; say so when quoting);
    `max_total_len` clips prompt + output to a model's context.
    """
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {name!r}")
    if n < 1:
        raise ValueError("n must be >= 1")
    rng = random.Random(seed)
    specs = {"fixed": _fixed, "mixed": _mixed, "chat": _chat}[name](n, rng)
    return [_clip(s, max_output_len, max_total_len) for s in specs]


def chat_table(path: Path = CHAT_TABLE) -> list[RequestSpec]:
    with path.open() as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    return [RequestSpec(int(r["prompt_len"]), int(r["output_len"])) for r in rows]


def prompt_token_ids(spec: RequestSpec, vocab_size: int, rng: random.Random) -> list[int]:
    # NOTE: ids below 100 are left out: they hold the special and control tokens.
    return [rng.randrange(100, vocab_size) for _ in range(spec.prompt_len)]


def _fixed(n: int, rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec(FIXED_LEN, FIXED_LEN) for _ in range(n)]


def _mixed(n: int, rng: random.Random) -> list[RequestSpec]:
    # NOTE: even positions short, odd positions long: a static batch of any size >= 2 then
    # holds both kinds and waits for its longest member, which is the case being measured.
    out = []
    for i in range(n):
        lo, hi = MIXED_SHORT if i % 2 == 0 else MIXED_LONG
        out.append(RequestSpec(rng.randint(*MIXED_PROMPT), rng.randint(lo, hi)))
    return out


def _chat(n: int, rng: random.Random) -> list[RequestSpec]:
    table = chat_table()
    return [rng.choice(table) for _ in range(n)]


def _clip(s: RequestSpec, max_output: int | None, max_total: int | None) -> RequestSpec:
    out = s.output_len if max_output is None else min(s.output_len, max_output)
    prompt = s.prompt_len
    if max_total is not None and prompt + out > max_total:
        prompt = max(1, max_total - out)
        out = min(out, max_total - prompt)
    return RequestSpec(prompt, out)
