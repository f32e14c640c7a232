"""Structured outputs: the per-step cost of grammar masks at 1, 8 and 64 running requests
against the same steps without a grammar, and the latency of a new schema (compile) against
a cached one. Both arms run in the same invocation on the same machine.

    python -m bench.structured [--model PATH] [--batches 1 8 64] [--steps 16] [--rounds 2]
                               [--grammar json|tools-auto]

`--grammar tools-auto`: the grammar of tool_choice auto with a strict tool (Hermes format)
instead of the schema; the model writes free text, the phase where a lazy lexeme watches for
`<tool_call>` at every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ipc.messages import AddRequest
from ipc.sampling import SamplingParams, StructuredOutputs

# NOTE: many items, each an object with a few typed fields: the mask is recomputed at every
# step in strings, numbers, enums and punctuation alike, and nothing ends early.
SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["person", "place", "thing"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["name", "kind", "score", "tags"], "additionalProperties": False},
}


def _prompt(core, i: int) -> list[int]:
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(core.tokenizer_dir)
    text = f"List {i} things as JSON objects with a name, kind, score and tags."
    return tok(text)["input_ids"]


def grammar_spec(kind: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json=json.dumps(SCHEMA))
    import msgspec

    from gateway.requests import Tool
    from gateway.structured import auto_tool_grammar

    tool = msgspec.convert({"type": "function", "function": {
        "name": "record", "strict": True, "parameters": SCHEMA["items"]}}, type=Tool)
    return StructuredOutputs(grammar=auto_tool_grammar([tool], True), param="tools")


def step_times(core, batch: int, steps: int, so: StructuredOutputs | None,
               tag: str) -> list[float]:
    """Seconds of each decode step with `batch` running requests (prefill not counted)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True,
                            structured_outputs=so)
    for i in range(batch):
        core.add_request(AddRequest(request_id=f"{tag}-{i}", prompt_token_ids=_prompt(core, i),
                                    sampling=params))
    while any(r.num_output_tokens == 0 for g in core.scheduler.groups.values() for r in g):
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    core.abort_requests([f"{tag}-{i}" for i in range(batch)])
    return times


def compile_latency(core, schema: dict, tag: str) -> float:
    """Seconds from add to the first sampled token of a one-token request with this schema."""
    params = SamplingParams(temperature=0.0, max_tokens=1,
                            structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    start = time.perf_counter()
    core.add_request(AddRequest(request_id=tag, prompt_token_ids=[1, 2, 3], sampling=params))
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grammar", choices=["json", "tools-auto"], default="json")
    args = parser.parse_args(argv)
    spec = grammar_spec(args.grammar)

    from engine.core import EngineCore
    from ipc.config import EngineConfig

    core = EngineCore(EngineConfig(model=args.model, max_model_len=512, num_gpu_blocks=2048,
                                   max_num_seqs=max(args.batches), enable_prefix_caching=False))
    step_times(core, 2, 2, spec, "warm")
    results: dict = {"steps": {}, "compile": {}}
    for batch in args.batches:
        plain, masked = [], []
        for r in range(args.rounds):  # NOTE: interleaved, so drift hits both arms alike
            plain += step_times(core, batch, args.steps, None, f"p{batch}-{r}")
            masked += step_times(core, batch, args.steps, spec, f"g{batch}-{r}")
        p, g = statistics.median(plain), statistics.median(masked)
        results["steps"][batch] = {"plain_ms": 1e3 * p, "grammar_ms": 1e3 * g,
                                   "added": g / p - 1}
        print(f"batch {batch:3d}: step {1e3 * p:7.1f} ms plain, {1e3 * g:7.1f} ms with "
              f"grammars: {100 * (g / p - 1):+.1f}%")
    fresh = [compile_latency(core, {**SCHEMA, "minItems": 100 + i}, f"new-{i}") for i in range(5)]
    cached = [compile_latency(core, {**SCHEMA, "minItems": 100}, f"hit-{i}") for i in range(5)]
    n, c = statistics.median(fresh), statistics.median(cached)
    stats = core.stats()
    mean = stats.grammar_compile_seconds_sum / max(stats.grammar_compiles, 1)
    results["compile"] = {"new_ms": 1e3 * n, "cached_ms": 1e3 * c, "compile_ms": 1e3 * mean}
    print(f"first token of a one-token request: new schema {1e3 * n:.1f} ms, "
          f"cached {1e3 * c:.1f} ms (compile itself: {1e3 * mean:.2f} ms on average)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
