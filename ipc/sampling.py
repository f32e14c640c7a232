"""Sampling parameters: one msgspec struct shared by the gateway, the wire and the engine."""

from __future__ import annotations

import math

import msgspec

from ipc.pooling import PoolingParams

# NOTE: below this, logits / temperature overflows float32 (1e-38 gives inf, then NaN): such
# temperatures mean greedy, as in vLLM (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A grammar the output must match (exactly one kind set); the engine compiles it.

    `param` names the request field it came from, so that a grammar the engine rejects (or
    cannot compile in time) is reported against that field.
    """

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar as llguidance takes it (may embed %json{...})
    whitespace_pattern: str | None = None  # JSON: the regex whitespace between tokens matches
    # a Lark grammar of what comes first, with `@answer` where the grammar above applies:
    # the model's reasoning, free until its end marker (gateway/reasoning/think.py)
    reasoning: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        _check(sum(kinds) == 1, self.param,
               "must set exactly one of json, json_object, regex, choice, grammar")
        _check(self.choice is None or len(self.choice) > 0, self.param,
               "choice must not be empty")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key)."""
        return (self.json, self.json_object, self.regex, self.choice, self.grammar,
                self.whitespace_pattern, self.reasoning)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to sample one request. Validated at construction (ValueError names the field)."""

    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop token ids are suppressed until this many tokens
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1  # choices returned; they share the prompt's KV blocks (copy-on-write)
    best_of: int | None = None  # sample this many choices, return the n most likely
    use_beam_search: bool = False  # beam search of width n; outputs arrive when it ends
    length_penalty: float = 1.0  # beam scores are divided by length ** length_penalty
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # logprobs of each prompt token after the first (with this many top alternatives)
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None  # constrain the output to a grammar
    # a pooling (embedding) request: prefill only, its prompt pooled into one vector
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1, 0 or positive")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        # NOTE: the upper bound is the engine's --max-logprobs (EngineConfig.max_logprobs)
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(1 <= self.n <= 64, "n", "must be in [1, 64]")
        _check(
            self.best_of is None or self.n <= self.best_of <= 64, "best_of", "must be in [n, 64]"
        )
        _check(_finite(self.length_penalty), "length_penalty", "must be finite")
        _check(all(t >= 0 and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
               "logit_bias", "needs token ids >= 0 and biases in [-100, 100]")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               "must be >= 0")
        if self.pooling is not None:
            _check(self.num_choices == 1 and not self.use_beam_search, "n",
                   "must be 1 for a pooling request")
        if self.use_beam_search:
            _check(self.prompt_logprobs is None, "prompt_logprobs",
                   "is not supported with use_beam_search")
            # NOTE: beams are chosen from the model's own logprobs, which the bias does not touch
            _check(not self.logit_bias, "logit_bias", "is not supported with use_beam_search")
            _check(self.best_of is None, "best_of", "cannot be combined with use_beam_search")
            _check(self.logprobs is None, "logprobs", "is not supported with use_beam_search")
            _check(self.structured_outputs is None, "structured_outputs",
                   "cannot be combined with use_beam_search")

    @property
    def num_choices(self) -> int:
        """How many choices the engine runs: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalty(self) -> bool:
        """A repetition, frequency or presence penalty applies (the sampler reads the output)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
