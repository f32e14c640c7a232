"""The one limits check (ipc/limits.py): each limit's boundary (the last value that passes, the
first that fails), the field it names and its code, counted by hand."""

from __future__ import annotations

import pytest

from ipc.limits import LimitError, Limits, check_limits, check_token_ids
from ipc.sampling import SamplingParams

LIMITS = Limits(max_model_len=100, max_logprobs=5, vocab_size=1000)


def _error(prompt: list[int], **sampling: object) -> LimitError | None:
    try:
        check_limits(LIMITS, prompt, SamplingParams(**sampling))  # type: ignore[arg-type]
    except LimitError as exc:
        return exc
    return None


def test_context_boundary_names_the_field_that_asked_too_much() -> None:
    assert _error([1] * 60, max_tokens=40) is None  # 60 + 40 = 100: fits exactly
    too_many = _error([1] * 60, max_tokens=41)
    assert too_many is not None
    assert (too_many.field, too_many.code) == ("max_tokens", "context_length_exceeded")
    assert str(too_many) == ("this model's maximum context length is 100 tokens; the prompt "
                             "(60 tokens) plus max_tokens (41) exceeds the context")
    assert _error([1] * 99, max_tokens=None) is None  # room for one output token
    full = _error([1] * 100, max_tokens=None)
    assert full is not None and (full.field, full.code) == ("prompt", "context_length_exceeded")
    assert "plus one output token exceeds" in str(full)
    # a prompt that alone fills the context is the prompt's fault even with a max_tokens
    assert _error([1] * 100, max_tokens=1).field == "prompt"  # type: ignore[union-attr]


def test_the_engines_note_says_why_the_context_is_lower() -> None:
    lowered = Limits(20, 5, 1000, " (what 5 KV blocks hold)")
    with pytest.raises(LimitError, match=r"is 20 tokens \(what 5 KV blocks hold\); the prompt"):
        check_limits(lowered, [1] * 20, SamplingParams(max_tokens=None))


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_cap(field: str) -> None:
    assert _error([1], **{field: 5}) is None
    error = _error([1], **{field: 6})
    assert error is not None and (error.field, error.code) == (field, "invalid_value")
    assert str(error) == f"{field} must be <= 5 (--max-logprobs)"


def test_vocabulary_bounds_name_the_first_id_outside() -> None:
    assert _error([0, 999], stop_token_ids=(999,), logit_bias=((999, 1.0),)) is None
    prompt = _error([0, 1000, 5])
    assert prompt is not None and (prompt.field, prompt.code) == ("prompt", "invalid_value")
    assert str(prompt) == ("prompt must be token ids in [0, 1000) (the vocabulary); got 1000")
    stop = _error([1], stop_token_ids=(3, 999, 1000, 2000))
    assert stop is not None and stop.field == "stop_token_ids[2]" and str(stop).endswith("1000")
    bias = _error([1], logit_bias=((7, 1.0), (1500, -2.0)))
    assert bias is not None and bias.field == "logit_bias.1500"
    with pytest.raises(LimitError, match=r"got -1") as caught:
        check_token_ids([5, -1], 1000, "tokens", indexed=False)
    assert caught.value.field == "tokens"


def test_limits_are_checked_in_a_fixed_order() -> None:
    """A request past several limits is told about the first: prompt ids, then context, then
    logprobs, then stop ids, then logit bias."""
    everything = dict(max_tokens=200, logprobs=9, stop_token_ids=(5000,),
                      logit_bias=((5000, 1.0),))
    assert _error([5000], **everything).field == "prompt"  # type: ignore[union-attr]
    assert _error([1], **everything).field == "max_tokens"  # type: ignore[union-attr]
    assert _error([1], **{**everything, "max_tokens": 1}).field == "logprobs"  # type: ignore[union-attr]
    assert _error([1], stop_token_ids=(5000,),  # type: ignore[union-attr]
                  logit_bias=((5000, 1.0),)).field == "stop_token_ids[0]"
