"""tool_choice auto with a strict tool, through the engine on a tiny random Llama: its tokenizer
has `<tool_call>` as one plain added token (as Qwen2.5's has), and a logit bias on it makes the
random model open a call (teacher forcing by the sampler); from there every token is the
random model's, masked by the grammar. Calls must parse and validate, with n > 1 too; without
the grammar the same bias writes no valid call. This random model's logits are so peaked that
its seeds agree, and a logit bias turns speculation off: tests/gateway/test_tool_grammars.py
draws tokens uniformly from the mask and rolls the matcher back inside a started call."""

from __future__ import annotations

import json
import shutil

import jsonschema
import msgspec
import pytest

from engine import LLM, SamplingParams
from gateway.requests import Tool
from gateway.structured import auto_tool_grammar
from gateway.tools.hermes import HermesParser
from gateway.tools.registry import CallSyntax
from ipc.sampling import StructuredOutputs
from tests.tiny_llama import build_tiny_llama

VOCAB = 49152  # the bundled vocabulary; `<tool_call>` becomes id VOCAB
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
PROMPT = ('Call: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"unit": "celsius", "days": 2}}\n</tool_call> Now you:')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bundled_tokenizer_dir):
    tok_dir = tmp_path_factory.mktemp("tool-tokenizer")
    for f in bundled_tokenizer_dir.iterdir():
        shutil.copy(f, tok_dir / f.name)
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": VOCAB, "content": "<tool_call>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": False})
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-tools"), tok_dir,
                            vocab_size=VOCAB + 1)


def _params(seed: int, grammar: bool, n: int = 1) -> SamplingParams:
    so = None
    if grammar:
        tools = [msgspec.convert(WEATHER, type=Tool)]
        so = StructuredOutputs(grammar=auto_tool_grammar(tools, False, CallSyntax("hermes")),
                               param="tools")
    return SamplingParams(temperature=1.0, max_tokens=100, seed=seed, n=n,
                          logit_bias=((VOCAB, 100.0),), structured_outputs=so)


def _calls(text: str) -> list[tuple[str, dict]]:
    parser = HermesParser()
    parser.feed(text, final=True)
    out = []
    for _, name, args in parser.named_calls:
        try:
            out.append((name, json.loads(args)))
        except ValueError:
            continue
    return out


def _valid(calls: list[tuple[str, dict]]) -> bool:
    try:
        for name, args in calls:
            assert name == "get_weather"
            jsonschema.validate(args, WEATHER["function"]["parameters"])
    except (AssertionError, jsonschema.ValidationError):
        return False
    return len(calls) == 1


def test_a_forced_opening_is_completed_by_the_grammar(model_dir):
    llm = LLM(str(model_dir), max_model_len=256, num_gpu_blocks=64)
    outs = llm.generate([PROMPT] * 3, [_params(seed, True) for seed in range(3)])
    outs += llm.generate([PROMPT], [_params(7, True, n=3)])
    texts = [(c.text, c.finish_reason) for o in outs for c in o.outputs]
    assert len(texts) == 6
    for text, reason in texts:
        assert text.startswith("<tool_call>\n") and reason == "stop", text
        assert _valid(_calls(text)), text
    unconstrained = llm.generate([PROMPT] * 3, [_params(s, False) for s in range(3)])
    assert all(o.text.startswith("<tool_call>") and not _valid(_calls(o.text))
               for o in unconstrained)
    assert llm.engine.kv.num_free_blocks == 64
