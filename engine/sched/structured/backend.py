"""llguidance behind a small interface: a spec becomes a grammar, a grammar a per-request
Matcher, and a batch of matchers one allowed-token bitmask applied to the logits."""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from engine.sched.structured.closing import Closer, Nesting
from engine.sched.structured.errors import GrammarError
from ipc.sampling import StructuredOutputs


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a spec; raises GrammarError on bad input."""
    answer = _answer_text(spec)
    if spec.reasoning is None:
        return answer
    return after_reasoning(spec.reasoning, answer)


def after_reasoning(reasoning: str, answer: str) -> str:
    """One grammar: the Lark `reasoning`, whose `@answer` is the grammar `answer` (llguidance
    joins several grammars of one request by name)."""
    try:
        top = json.loads(answer)
    except ValueError:  # NOTE: llguidance takes plain Lark text as a grammar too
        top = {"grammars": [{"lark_grammar": answer}]}
    grammars = top["grammars"]
    grammars[0] = {**grammars[0], "name": "answer"}
    return json.dumps({**top, "grammars": [{"lark_grammar": reasoning}, *grammars]})


def _answer_text(spec: StructuredOutputs) -> str:
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        options = json_options(spec.whitespace_pattern)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}", spec.param) from None
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def json_options(whitespace_pattern: str | None = None) -> dict:
    """llguidance's JSON options: `json.dumps` spacing unless a whitespace pattern is given.

    NOTE: llguidance allows any whitespace by default; a model (a random one above all) can
    then spend its whole budget on it. oneOf is approximated by anyOf, as vLLM does.
    """
    options: dict = {"coerce_one_of": True, "item_separator": ", ", "key_separator": ": ",
                     "whitespace_flexible": False}
    if whitespace_pattern is not None:
        options.update(whitespace_flexible=True, whitespace_pattern=whitespace_pattern,
                       item_separator=",", key_separator=":")
    return options


class Matcher:
    """One choice's position in its grammar; mirrors the choice's output tokens. With a
    Closer it also tracks the text's JSON nesting, for `closing_path`."""

    def __init__(self, matcher: llguidance.LLMatcher, closer: Closer | None = None,
                 nestings: list[Nesting] | None = None) -> None:
        self._m = matcher
        self._closer = closer
        self._nestings = nestings or [Nesting()]  # [i]: after the first i tokens

    def fork(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self._closer, list(self._nestings))

    @property
    def closes_on_budget(self) -> bool:
        return self._closer is not None

    def closing_path(self, limit: int, after: int | None = None, ends: Sequence[int] = ()
                     ) -> list[int] | None:
        """A completion the grammar accepts, of at most `limit` tokens, from here (or from
        after the token `after`), ending with one of `ends` where the grammar would take more;
        None if none is found (or no Closer)."""
        if self._closer is None:
            return None
        nesting = self._nestings[-1]
        if after is None:
            return self._closer.path(self._m, nesting, limit, ends)
        m = self._m.deep_copy()
        if not m.consume_token(after):
            return None
        return self._closer.path(m, nesting.feed(self._closer.token_bytes(after)), limit, ends)

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar refuses it."""
        ok = self._m.consume_token(token_id)
        if ok and self._closer is not None:
            self._nestings.append(self._nestings[-1].feed(self._closer.token_bytes(token_id)))
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            assert self._m.rollback(num_tokens), self._m.get_error()
            if self._closer is not None:
                del self._nestings[-num_tokens:]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar would take from here (nothing is consumed)."""
        return self._m.validate_tokens(list(tokens))

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self._m, bitmask, row)


class Grammar:
    """A compiled grammar: a matcher at its start, forked for each request that uses it."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str, param: str,
                 closer: Closer | None = None) -> None:
        """closer: the budget-closing search its matchers use (None: they never close)."""
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}", param)
        self._start = matcher
        self._closer = closer

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self._closer)


class Masker:
    """Fills allowed-token bitmasks for a batch of matchers (the sampler applies them)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()

    def bitmask(self, matchers: Sequence[Matcher]) -> np.ndarray:
        """int32 [len(matchers), ceil(vocab / 32)]: bit t of row i set = token t allowed."""
        mask = np.empty((len(matchers), self.words), dtype=np.int32)
        if len(matchers) == 1:
            matchers[0].fill(mask, 0)
        else:
            fill_next_token_bitmask_par(self._executor,
                                        [(m.raw, i) for i, m in enumerate(matchers)], mask)
        return mask
