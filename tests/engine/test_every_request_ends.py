"""Every request with a grammar ends: each grammar kind (JSON schema, JSON object, regex, choice,
Lark, tool calls in every format, one call or parallel, tool_choice required, named or auto) is
driven on a tiny random Llama to every budget from 1 to past its natural length, greedy and
sampled; each reply ends (a terminal delta) within 2 steps per output token, the budget closing
never leaves a grammar open where a closing fits, and KV blocks balance.

Before budget closing forced the end token, a complete grammar that admits more (`( a b)+`, a
parallel call list) refused the sampled token forever and the engine spun on one request."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine import LLM
from gateway.requests import Tool
from gateway.structured import auto_tool_grammar, tool_call_grammar
from gateway.tools.registry import CallSyntax
from ipc.messages import AddRequest, TokenDelta
from ipc.sampling import SamplingParams, StructuredOutputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
        "additionalProperties": False}}}
TOOLS = [msgspec.convert(t, type=Tool) for t in (WEATHER, TIME)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"], "additionalProperties": False}


def _specs() -> dict[str, StructuredOutputs]:
    specs = {
        "json_schema": StructuredOutputs(json=json.dumps(SCHEMA), param="response_format"),
        "json_object": StructuredOutputs(json_object=True, param="response_format"),
        "regex_repeat": StructuredOutputs(regex="( a b)+", param="structured_outputs"),
        "regex_once": StructuredOutputs(regex="[0-9]{3}-[a-z]+", param="structured_outputs"),
        "choice": StructuredOutputs(choice=("yes", "no", "it depends"), param="structured_outputs"),
        "lark": StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]+/',
                                  param="structured_outputs"),
    }
    for parser in ("hermes", "llama3_json", "mistral"):
        syntax = CallSyntax(parser)
        for parallel in (False, True):
            specs[f"required_{parser}_{parallel}"] = StructuredOutputs(
                grammar=tool_call_grammar(TOOLS, parallel, syntax), param="tools")
        specs[f"named_{parser}"] = StructuredOutputs(
            grammar=tool_call_grammar(TOOLS[:1], False, syntax), param="tools")
        specs[f"auto_{parser}"] = StructuredOutputs(
            grammar=auto_tool_grammar(TOOLS, True, syntax), param="tools")
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=512, num_gpu_blocks=256)


def _run(llm: LLM, spec: StructuredOutputs, max_tokens: int, seed: int | None,
         bound: int | None = None, **fields) -> tuple[int, TokenDelta, list[int]]:
    """(steps, terminal delta, tokens) of one request run alone; fails past `bound` steps."""
    core = llm.engine
    core.add_request(AddRequest(
        request_id="r", prompt_token_ids=llm.tokenizer.encode("Call a tool: "),
        sampling=SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                                max_tokens=max_tokens, structured_outputs=spec, **fields)))
    tokens: list[int] = []
    # NOTE: the grammar is compiled (an LRU cache hit after the first run): admission and the
    # prompt take a step, and every output position at most two (one refused token)
    bound = bound or 2 * max_tokens + 4
    for step in range(1, bound + 1):
        for d in core.step():
            tokens += d.new_token_ids
            if d.finished:
                assert not core.has_unfinished_requests()
                return step, d, tokens
    core.abort_requests(["r"])
    while core.has_unfinished_requests():
        core.step()
    pytest.fail(f"no terminal delta within {bound} steps ({max_tokens=}, {seed=}): "
                f"{llm.tokenizer.decode(tokens)!r}")


def _natural(llm: LLM, spec: StructuredOutputs, seed: int | None) -> int:
    _, d, tokens = _run(llm, spec, 96, seed)
    return len(tokens) if d.finish_reason == "stop" else 96


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_budget_ends(llm: LLM, name: str, seed: int | None) -> None:
    spec = SPECS[name]
    _run(llm, spec, 8, seed, bound=10_000)  # compiles the grammar
    natural = min(_natural(llm, spec, seed), 20)  # NOTE: the suite's time; 20 covers each closing
    for max_tokens in range(1, natural + 2):
        _, d, tokens = _run(llm, spec, max_tokens, seed)
        assert d.finish_reason in ("stop", "length"), (max_tokens, d)
        assert len(tokens) <= max_tokens
    assert llm.engine.kv.num_free_blocks == 256


def test_a_complete_grammar_that_admits_more_is_ended_by_its_end_token(llm: LLM) -> None:
    """`( a b)+` with max_tokens 3: ` a b` is complete and a second ` a b` cannot fit, so
    the end token is forced (this request once spun forever)."""
    spec = SPECS["regex_repeat"]
    _run(llm, spec, 8, None, bound=10_000)
    eos = llm.engine.eos_token_ids
    for max_tokens in (3, 4, 6, 7):
        _, d, tokens = _run(llm, spec, max_tokens, None)
        assert d.finish_reason == "stop" and tokens[-1] in eos, (max_tokens, tokens)
        text = llm.tokenizer.decode(tokens[:-1])
        assert text.replace(" a b", "") == "" and text, text


def test_without_an_end_token_a_complete_grammar_runs_to_its_budget(llm: LLM) -> None:
    """ignore_eos: nothing can end the reply early, so nothing is refused forever either."""
    spec = SPECS["regex_repeat"]
    _run(llm, spec, 8, None, bound=10_000)
    for max_tokens in (3, 4, 5):
        steps, d, tokens = _run(llm, spec, max_tokens, None, ignore_eos=True)
        assert d.finish_reason == "length" and len(tokens) == max_tokens
        assert steps == max_tokens  # NOTE: one token a step: nothing to force, none refused


def test_min_tokens_holds_the_end_token_back(llm: LLM) -> None:
    """The closing forces no end token that min_tokens still bans (the end would come early,
    or no token would be allowed at all): an end comes only after min_tokens others."""
    spec = SPECS["regex_repeat"]
    _run(llm, spec, 8, None, bound=10_000)
    eos = llm.engine.eos_token_ids
    for max_tokens, min_tokens in ((3, 2), (4, 3), (6, 5), (7, 5)):
        _, d, tokens = _run(llm, spec, max_tokens, None, min_tokens=min_tokens)
        assert d.finish_reason in ("stop", "length") and d.error is None, d
        if tokens[-1] in eos:
            assert len(tokens) > min_tokens, (max_tokens, min_tokens, tokens)
        else:
            assert len(tokens) == max_tokens
