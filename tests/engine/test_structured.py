"""Structured outputs on a tiny random Llama: every sampled output matches its grammar (checked
with the `jsonschema` package and `re`), whatever the seed, batch, speculation or preemption;
grammars that fail end only their own request, naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import tokenizers

from engine import LLM, SamplingParams
from engine.sched.request import RequestStatus
from engine.sched.structured.tokenizer import token_bytes
from ipc.sampling import StructuredOutputs

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "address": {"type": "object", "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"enum": ["Paris", "Oslo", "Lima"]}},
                "required": ["zip", "city"], "additionalProperties": False},
        },
        "required": ["name", "age", "address"], "additionalProperties": False,
    },
    "arrays_anyof": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                     "minItems": 1, "maxItems": 3},
            "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                {"type": "boolean"}, {"type": "null"}]},
            "ratio": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
        },
        "required": ["tags", "value", "ratio"], "additionalProperties": False,
    },
    "one_of_list": {
        "type": "array", "maxItems": 2,
        "items": {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}},
                             "required": ["k"], "additionalProperties": False},
                            {"type": "string", "pattern": "^[a-z]{1,3}$"}]},
    },
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=128)


def _json(schema: dict, param: str = "response_format") -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema), param=param)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sampled_output_validates(llm, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=seed,
                             structured_outputs=_json(schema)) for seed in range(16)]
    outs = llm.generate(["Tell me"] * 16, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1  # really sampled, not one forced string
    assert llm.engine.kv.num_free_blocks == 128


def test_regex_choice_and_lark(llm):
    regex = StructuredOutputs(regex=r"[A-Z][a-z]{2,5}-[0-9]{2}")
    choice = StructuredOutputs(choice=("yes", "no", "maybe so"))
    lark = StructuredOutputs(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/')
    for seed in range(6):
        r, c, g = llm.generate(["a", "b", "c"], [
            SamplingParams(temperature=1.0, max_tokens=40, seed=seed, structured_outputs=s)
            for s in (regex, choice, lark)])
        assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", r.text), r.text
        assert c.text in ("yes", "no", "maybe so") and c.finish_reason == "stop"
        assert re.fullmatch(r"\((\d{1,2})(\+\d{1,2})*\)", g.text) or g.finish_reason == "length"


def test_max_tokens_mid_json_finishes_with_length(llm):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 30}},
              "required": ["s"]}
    out = llm.generate("x", SamplingParams(temperature=1.0, max_tokens=5, seed=3,
                                           structured_outputs=_json(schema)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"s": "')


def test_n_choices_each_follow_the_grammar(llm):
    schema = SCHEMAS["arrays_anyof"]
    out = llm.generate("n", SamplingParams(n=3, temperature=1.0, max_tokens=80, seed=11,
                                           structured_outputs=_json(schema)))[0]
    assert len(out.outputs) == 3
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), schema)


def test_greedy_grammar_output_is_the_same_with_speculation_and_preemption(tiny_model_dir):
    schema = SCHEMAS["nested"]
    prompts = [f"p{i} " * (i + 1) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=45, structured_outputs=_json(schema))
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=45,
                             structured_outputs=_json(schema))
    results = []
    for options in ({}, {"speculative_method": "ngram", "num_speculative_tokens": 3},
                    {"speculative_method": "self", "speculative_draft_layers": 1},
                    {"num_gpu_blocks": 20, "block_size": 4, "preemption_mode": "swap"},
                    {"num_gpu_blocks": 20, "block_size": 4, "preemption_mode": "recompute"}):
        # NOTE: budget closing turns speculation off for its requests (engine/sched/grammar.py
        # says why); this test is of speculation and preemption, so it runs without it
        llm = LLM(str(tiny_model_dir), max_model_len=256, structured_output_close_on_budget=False,
                  **({"num_gpu_blocks": 128} | options))
        outs = llm.generate(prompts, [greedy] * len(prompts))
        for out in llm.generate(prompts, [sampled] * len(prompts)) + outs:
            jsonschema.validate(json.loads(out.text), schema)
        stats = llm.engine.stats()
        if "speculative_method" in options:
            assert stats.spec_draft_tokens > 0
        if "preemption_mode" in options:
            assert stats.num_preemptions > 0
        results.append([o.token_ids for o in outs])
    assert all(r == results[0] for r in results[1:])


def test_failed_grammars_end_only_their_request(tiny_model_dir):
    def nest(depth: int) -> dict:
        if depth == 0:
            return {"type": "string"}
        return {"oneOf": [nest(depth - 1), {"type": "array", "items": nest(depth - 1)},
                          {"type": "object", "properties": {"k": nest(depth - 1)}}]}

    # NOTE: this schema compiles in about 0.6 s here; the timeout is 30x shorter.
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=64,
              structured_output_compile_timeout=0.02)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ok = SamplingParams(temperature=0, max_tokens=40,
                        structured_outputs=StructuredOutputs(choice=("up", "down")))
    slow = SamplingParams(max_tokens=10, structured_outputs=_json(nest(8), "tools"))
    bad = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputs(
        regex="(unclosed", param="structured_outputs"))
    outs = llm.generate(["a", "b", "c", "d"], [plain, slow, bad, ok])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 6
    assert outs[1].finish_reason == "error" and outs[1].outputs[0].error_param == "tools"
    assert "did not compile within" in outs[1].outputs[0].error
    assert outs[2].finish_reason == "error"
    assert outs[2].outputs[0].error_param == "structured_outputs"
    assert outs[3].text in ("up", "down")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == 64
    stats = llm.engine.stats()
    assert stats.grammar_failures == 2 and stats.grammar_waits >= 3
    again, cached_bad = llm.generate(["e", "f"], [ok, bad])  # the engine keeps serving
    assert again.text in ("up", "down") and llm.engine.stats().grammar_cache_hits >= 2
    assert cached_bad.finish_reason == "error"  # a cached failure still ends its request


def test_prefix_cache_hit_and_stop_strings_with_a_grammar(llm):
    schema = {"type": "object", "properties": {"w": {"enum": ["alpha", "beta"]},
                                                "n": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}},
              "required": ["w", "n"], "additionalProperties": False}
    prompt = "shared prefix " * 12
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=_json(schema))
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert second.num_cached_tokens > 0 and first.token_ids == second.token_ids
    jsonschema.validate(json.loads(first.text), schema)
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=('"n"',),
                                              structured_outputs=_json(schema)))[0]
    assert cut.finish_reason == "stop" and first.text.startswith(cut.text)
    assert '"n"' not in cut.text


def test_token_bytes_match_the_tokenizer(bundled_tokenizer_dir):
    path = bundled_tokenizer_dir / "tokenizer.json"
    tok = tokenizers.Tokenizer.from_file(str(path))
    tokens = token_bytes(tok, json.loads(path.read_text()), tok.get_vocab_size())
    text = 'Grüße, 東京! {"a": [1, 2]}\n\tend — ok'
    ids = tok.encode(text).ids
    assert b"".join(tokens[i] for i in ids).decode("utf-8") == tok.decode(ids)
    assert tokens[2] == b"<|im_end|>"


def test_waiting_for_grammar_is_not_finished():
    assert not RequestStatus.WAITING_FOR_GRAMMAR.finished
    assert RequestStatus.WAITING < RequestStatus.WAITING_FOR_GRAMMAR < RequestStatus.RUNNING
    assert all(s.finished for s in RequestStatus if s > RequestStatus.PREEMPTED)


def test_abort_while_the_grammar_compiles(tiny_model_dir):
    from ipc.messages import AddRequest

    llm = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=16)
    core = llm.engine
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}}
    core.add_request(AddRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(structured_outputs=_json(schema))))
    assert core.scheduler.groups["r"][0].status == RequestStatus.WAITING_FOR_GRAMMAR
    (delta,) = core.abort_requests(["r"])
    assert delta.finish_reason == "abort" and not core.has_unfinished_requests()
    assert core.step() == [] and core.kv.num_free_blocks == 16
