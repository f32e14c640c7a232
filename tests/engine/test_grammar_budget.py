"""Budget closing on a tiny random Llama (whose strings run on until cut): with a grammar and
max_tokens, every reply that max_tokens leaves room to close validates with `jsonschema`
(and without closing, most are cut open); KV blocks balance, n > 1 choices each close, and
so do replies with speculative decoding on."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from ipc.sampling import StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "bio": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "bio", "tags"]}
SHORTEST = 13  # tokens of {"name": "", "bio": "", "tags": []}: no shorter reply is valid


def _outputs(llm: LLM, max_tokens: int, seeds: range, n: int = 1) -> list:
    spec = StructuredOutputs(json=json.dumps(SCHEMA), param="response_format")
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=s, n=n,
                             structured_outputs=spec) for s in seeds]
    return [c for o in llm.generate(["Tell me"] * len(seeds), params) for c in o.outputs]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=128)


def test_shortest_fits_in_the_tokenizer(tiny_model_dir) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert len(tok.encode('{"name": "", "bio": "", "tags": []}').ids) == SHORTEST


@pytest.mark.parametrize("max_tokens", [SHORTEST, SHORTEST + 1, 17, 24, 40])
def test_replies_close_within_max_tokens(llm: LLM, max_tokens: int) -> None:
    outs = _outputs(llm, max_tokens, range(6))
    for out in outs:
        assert len(out.token_ids) <= max_tokens
        assert _valid(out.text), out.text
        assert out.finish_reason == "stop"  # the grammar ended it, complete
    assert llm.engine.kv.num_free_blocks == 128


def test_n_choices_each_close(llm: LLM) -> None:
    outs = _outputs(llm, 20, range(3), n=3)
    assert len(outs) == 9 and all(_valid(o.text) for o in outs), [o.text for o in outs]
    assert llm.engine.kv.num_free_blocks == 128


def test_without_room_for_any_closing_the_reply_is_cut_as_before(llm: LLM) -> None:
    outs = _outputs(llm, SHORTEST - 1, range(3))
    assert all(o.finish_reason == "length" and not _valid(o.text) for o in outs)


def test_the_flag_off_cuts_the_same_replies(tiny_model_dir) -> None:
    off = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=128,
              structured_output_close_on_budget=False)
    outs = _outputs(off, 24, range(6))
    cut = [o for o in outs if not _valid(o.text)]
    assert len(cut) >= 3 and all(o.finish_reason == "length" for o in cut)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_replies_close_through_preemption(tiny_model_dir, mode: str) -> None:
    small = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=20, block_size=4,
                preemption_mode=mode)
    outs = _outputs(small, 30, range(6))
    assert all(_valid(o.text) for o in outs), [o.text for o in outs]
    assert small.engine.stats().num_preemptions > 0


def test_replies_close_with_speculative_decoding(tiny_model_dir) -> None:
    # NOTE: drafts are verified against the grammar's own masks, which the closing does not
    # narrow: a choice that closes on its budget decodes one token at a time. N-gram lookup
    # drafts (cut where the grammar refuses them) are the ones a JSON reply accepts.
    spec = LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=128,
               speculative_method="ngram", num_speculative_tokens=4)
    for max_tokens in (SHORTEST + 1, 24):
        outs = _outputs(spec, max_tokens, range(6))
        assert all(_valid(o.text) and o.finish_reason == "stop" for o in outs), \
            [o.text for o in outs]
        assert all(len(o.token_ids) <= max_tokens for o in outs)
    assert spec.engine.kv.num_free_blocks == 128
