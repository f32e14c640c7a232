"""The request limits the gateway and the engine both check, in one wording: the context
length, the logprobs cap (`--max-logprobs`) and the vocabulary's bounds. The gateway checks
first and names the route's field; the engine checks again for clients that reach it directly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ipc.sampling import SamplingParams


class LimitError(ValueError):
    """A request past a limit. `field` names what is at fault in AddRequest terms (`prompt`,
    `max_tokens`, `logprobs`, `prompt_logprobs`, `stop_token_ids[i]`, `logit_bias.<id>`);
    `code` is the OpenAI error code the gateway answers with."""

    def __init__(self, message: str, field: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field, self.code = field, code


@dataclass(frozen=True)
class Limits:
    max_model_len: int  # prompt plus output tokens (the engine's, lowered to its KV pool)
    max_logprobs: int  # top logprobs per token
    vocab_size: int  # token ids are in [0, vocab_size)
    context_note: str = ""  # why max_model_len is lower than the model's, if it is


def check_limits(limits: Limits, prompt: Sequence[int], sampling: SamplingParams) -> None:
    """Raise LimitError for the first limit the request passes, in this order: prompt token
    ids, context, logprobs, prompt logprobs, stop token ids, logit bias token ids.
    `sampling.max_tokens` None asks for what is left of the context (at least one token)."""
    check_token_ids(prompt, limits.vocab_size, "prompt", indexed=False)
    check_context(limits, len(prompt), sampling.max_tokens)
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(sampling, field)
        if asked is not None and asked > limits.max_logprobs:
            raise LimitError(f"{field} must be <= {limits.max_logprobs} (--max-logprobs)", field)
    check_token_ids(sampling.stop_token_ids, limits.vocab_size, "stop_token_ids")
    for token, _ in sampling.logit_bias:
        if not 0 <= token < limits.vocab_size:
            raise LimitError(_outside("logit_bias keys", token, limits.vocab_size),
                             f"logit_bias.{token}")


def check_pooling_input(limits: Limits, prompt: Sequence[int]) -> None:
    """A pooling (embedding) input: token ids in the vocabulary, at least one, and all of them
    within the context (no output token is asked for)."""
    if not prompt:
        raise LimitError("input must not be empty", "prompt")
    check_token_ids(prompt, limits.vocab_size, "prompt", indexed=False)
    if len(prompt) > limits.max_model_len:
        raise LimitError(
            f"this model's maximum context length is {limits.max_model_len} tokens"
            f"{limits.context_note}; the input ({len(prompt)} tokens) exceeds the context",
            "prompt", "context_length_exceeded")


def check_context(limits: Limits, prompt_len: int, max_tokens: int | None) -> None:
    """The prompt plus max_tokens (None: one token, the least a reply needs) must fit."""
    if prompt_len + (max_tokens or 1) <= limits.max_model_len:
        return
    asks = "one output token" if max_tokens is None else f"max_tokens ({max_tokens})"
    raise LimitError(
        f"this model's maximum context length is {limits.max_model_len} tokens"
        f"{limits.context_note}; the prompt ({prompt_len} tokens) plus {asks} exceeds the "
        "context",
        "prompt" if prompt_len >= limits.max_model_len else "max_tokens",
        "context_length_exceeded")


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str,
                    indexed: bool = True) -> None:
    """Every id in [0, vocab_size); the error's field is `field[i]` (`indexed`) or `field`."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return  # NOTE: min and max run in C: a long prompt costs microseconds
    i, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise LimitError(_outside(field, token, vocab_size), f"{field}[{i}]" if indexed else field)


def _outside(what: str, token: int, vocab_size: int) -> str:
    return f"{what} must be token ids in [0, {vocab_size}) (the vocabulary); got {token}"
