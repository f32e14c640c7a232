"""Budget closing's search (engine/sched/structured/closing.py): from any state a grammar can reach,
the completion it finds is accepted by the grammar and the whole text validates against the
schema with the `jsonschema` package; and it is short (no longer than a hand-closed text)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import tokenizers
from test_structured import SCHEMAS

from engine.sched.structured.backend import Grammar, grammar_text
from engine.sched.structured.closing import Closer, Nesting
from engine.sched.structured.tokenizer import build_lltokenizer
from ipc.sampling import StructuredOutputs

PERSON = {  # what the openai SDK sends for a Pydantic model
    "type": "object", "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "biography": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}},
                   "address": {"type": "object", "additionalProperties": False,
                               "properties": {"city": {"type": "string", "minLength": 3},
                                              "zip": {"type": "integer"}},
                               "required": ["city", "zip"]}},
    "required": ["name", "biography", "hobbies", "address"],
}
ALL = {**SCHEMAS, "person": PERSON}


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> tuple[tokenizers.Tokenizer, Closer, object]:
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    lltok = build_lltokenizer(tiny_model_dir, tok.get_vocab_size(), [eos])
    return tok, Closer(lltok), lltok


def _grammar(vocab, schema: dict) -> Grammar:
    _, closer, lltok = vocab
    return Grammar(lltok, grammar_text(StructuredOutputs(json=json.dumps(schema))), "x", closer)


def _allowed(matcher, vocab_size: int) -> list[int]:
    bits = np.frombuffer(matcher.raw.compute_bitmask(), dtype="<u4")
    ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    return [int(t) for t in ids if t < vocab_size]


@pytest.mark.parametrize("name", sorted(ALL))
def test_random_prefixes_close_to_valid_documents(vocab, name: str) -> None:
    tok, closer, _ = vocab
    grammar, schema = _grammar(vocab, ALL[name]), ALL[name]
    rng = random.Random(name)
    end = tok.token_to_id("<|im_end|>")
    for _ in range(12):
        m, walked = grammar.matcher(), []
        for _ in range(rng.randrange(0, 40)):
            if m.stopped or m.raw.is_accepting():
                break
            t = rng.choice([t for t in _allowed(m, closer.vocab_size) if t != end])
            assert m.accept(t)
            walked.append(t)
        path = m.closing_path(200)
        assert path is not None, tok.decode(walked)
        for t in path:
            assert m.accept(t)
        assert m.raw.is_accepting()
        text = tok.decode(walked + path)
        jsonschema.validate(json.loads(text), schema)


def test_a_cut_string_closes_in_few_tokens(vocab) -> None:
    tok, _, _ = vocab
    text = '{"name": "Ann", "biography": "Ann was born in a small town by the sea and'
    m = _grammar(vocab, PERSON).matcher()
    for t in tok.encode(text).ids:
        assert m.accept(t)
    path = m.closing_path(200)
    assert path is not None
    done = json.loads(text + tok.decode(path))
    jsonschema.validate(done, PERSON)
    # by hand: `", "hobbies": [], "address": {"city": "aaa", "zip": 0}}`
    hand = tok.encode('", "hobbies": [], "address": {"city": "aaa", "zip": 0}}').ids
    assert len(path) <= len(hand)
    assert m.closing_path(len(path) - 1) is None  # the limit is honoured


def test_nesting_reads_strings_and_escapes() -> None:
    n = Nesting().feed(b'{"a": [1, {"b": "x\\"]}')
    assert (n.stack, n.in_string, n.escape) == (b"}]}", True, False)
    assert n.ideal() == b'"}]}'
    assert Nesting().feed(b'{"a": "\\').ideal() == b""  # an escape must end first
