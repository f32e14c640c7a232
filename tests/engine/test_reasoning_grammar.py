"""A grammar after reasoning: free text until `</think>`, then the request's grammar (every
kind), checked by llguidance on the tiny thinking Qwen3's tokenizer."""

from __future__ import annotations

import json

import pytest
from tiny_qwen3 import VOCAB, tiny_qwen3_dir

from engine.sched.structured.backend import Grammar, grammar_text
from engine.sched.structured.tokenizer import build_lltokenizer
from gateway.reasoning import REASONING_PARSERS
from gateway.tokenizer import Tokenizer
from ipc.sampling import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
# kind -> (spec fields, an answer it takes, one it refuses)
KINDS = {
    "json": (dict(json=json.dumps(SCHEMA)), '{"a": 5}', '{"b": 5}'),
    "regex": (dict(regex="[0-9]{2}"), "42", "4x"),
    "choice": (dict(choice=("yes", "no")), "no", "maybe"),
    "grammar": (dict(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x12", "y12"),
}
THOUGHT = "<think>\nI consider {x} and </thi, not the end.\n</think>"  # the answer follows at once


@pytest.fixture(scope="module")
def tools():
    d = tiny_qwen3_dir()
    return build_lltokenizer(d, VOCAB, [2]), Tokenizer(d)


def _takes(tools, spec: StructuredOutputs, text: str) -> bool:
    lltok, tok = tools
    matcher = Grammar(lltok, grammar_text(spec), spec.param).matcher()
    ids = tok.encode(text)
    if matcher.valid_prefix(ids) != len(ids):
        return False
    for t in ids:
        assert matcher.accept(t)
    return matcher.raw.is_accepting()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_grammar_applies_after_the_reasoning(tools, kind: str) -> None:
    fields, good, bad = KINDS[kind]
    qwen3 = REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n").grammar()
    spec = StructuredOutputs(**fields, reasoning=qwen3)
    assert _takes(tools, spec, THOUGHT + good)
    assert _takes(tools, spec, good)  # qwen3: the model may answer without thinking
    assert not _takes(tools, spec, THOUGHT + bad)
    assert not _takes(tools, spec, "<think>never ends " + good)
    assert not _takes(tools, StructuredOutputs(**fields), THOUGHT + good)  # without: refused


def test_reasoning_opened_by_the_template_must_end(tools) -> None:
    fields, good, _ = KINDS["json"]
    r1 = REASONING_PARSERS["deepseek_r1"]("<|im_start|>assistant\n<think>\n").grammar()
    spec = StructuredOutputs(**fields, reasoning=r1)
    assert _takes(tools, spec, "free { text </think>" + good)
    assert not _takes(tools, spec, good)  # the answer comes only after </think>


def test_a_prompt_that_ended_the_reasoning_needs_no_prefix() -> None:
    closed = REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.grammar() is None
