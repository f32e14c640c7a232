"""The tokens a grammar needs to end: a short accepted completion from a matcher's state,
found by a greedy search that reads the JSON nesting of the text so far (budget closing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import llguidance
import numpy as np

# NOTE: tried in this order once the closers that match the nesting are refused: the next
# item (where a value ended and required ones remain; refused where a value must come), a
# value's shortest forms, then what opens one (a string with a minLength, a list, an object).
_VALUES = (b",", b'""', b"0", b"[]", b"{}", b"true", b"null", b"false", b'"', b"a", b"[",
           b"{", b"-", b" ")
_CLOSERS = frozenset(b'"}]')


class Nesting(NamedTuple):
    """Where JSON text stands: open brackets (innermost last), inside a string, after `\\`."""

    stack: bytes = b""
    in_string: bool = False
    escape: bool = False

    def feed(self, data: bytes) -> Nesting:
        stack, in_string, escape = bytearray(self.stack), self.in_string, self.escape
        for byte in data:
            if in_string:
                if escape:
                    escape = False
                elif byte == 0x5C:  # backslash
                    escape = True
                elif byte == 0x22:
                    in_string = False
            elif byte == 0x22:
                in_string = True
            elif byte in b"{[":
                stack.append(0x7D if byte == 0x7B else 0x5D)  # the bracket that closes it
            elif byte in b"}]" and stack:
                stack.pop()
        return Nesting(bytes(stack), in_string, escape)

    def ideal(self) -> bytes:
        """The bytes that would close everything from here (if the grammar allows it)."""
        if self.escape:
            return b""  # NOTE: the escape must be finished first; the fallbacks do that
        closing = bytes(reversed(self.stack))
        return b'"' + closing if self.in_string else closing


class Closer:
    """Closing searches over one tokenizer's vocabulary (built once per engine)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self._eos = frozenset(tokenizer.eos_tokens)
        self._bytes: dict[int, bytes] = {}
        self._closers: dict[bytes, int] = {}  # tokens made only of `"`, `}`, `]`, by bytes
        for t in range(self.vocab_size):
            b = tokenizer.decode_bytes([t])
            if b and all(c in _CLOSERS for c in b) and t not in self._eos:
                self._closers.setdefault(b, t)
        self._values = [t for t in (self._single(v) for v in _VALUES) if t is not None]
        self._letter = self._single(b"a")

    def token_bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._tok.decode_bytes([token])
        return b

    def path(self, matcher: llguidance.LLMatcher, nesting: Nesting, limit: int,
             ends: Sequence[int] = ()) -> list[int] | None:
        """Tokens that take a copy of `matcher` to an accepting state, at most `limit` of
        them; None when this search finds none that short. Each step takes the forced tokens
        if the grammar forces any, else the longest closer of the open nesting it accepts,
        else a value's shortest form, else the lowest token id it allows. Where the grammar
        would still take more there and `limit` has room, the path ends with the first of
        `ends` (tokens that end the reply) it accepts: a complete grammar ends the reply."""
        m = matcher.deep_copy()
        path: list[int] = []
        steps = 2 * limit + 8  # NOTE: its steps split tokens that _shorter merges again
        while not m.is_accepting():
            if len(path) >= steps or m.is_stopped():
                return None
            step = self._forced(m) or [self._next(m, nesting)]
            if step == [None] or m.try_consume_tokens(step) != len(step):  # type: ignore[arg-type]
                return None
            for t in step:
                nesting = nesting.feed(self.token_bytes(t))  # type: ignore[arg-type]
            path += step  # type: ignore[arg-type]
        path = self._shorter(matcher, path)
        if ends and len(path) < limit and not m.is_stopped():
            end = next((e for e in ends if m.validate_tokens([e]) == 1), None)
            path += [] if end is None else [end]
        return path if len(path) <= limit else None

    def _shorter(self, matcher: llguidance.LLMatcher, path: list[int]) -> list[int]:
        """The path's bytes tokenized whole, if that is shorter and the grammar takes it (the
        steps split what one token may hold, such as `", "`)."""
        whole = self._tok.tokenize_bytes(b"".join(self.token_bytes(t) for t in path))
        if len(whole) >= len(path):
            return path
        m = matcher.deep_copy()
        return whole if m.try_consume_tokens(whole) == len(whole) and m.is_accepting() else path

    def _forced(self, m: llguidance.LLMatcher) -> list[int]:
        forced = m.compute_ff_tokens()
        if forced:
            return forced
        data = m.compute_ff_bytes()
        if not data:
            return []
        ids = self._tok.tokenize_bytes(data)
        return ids[: m.validate_tokens(ids)]

    def _next(self, m: llguidance.LLMatcher, nesting: Nesting) -> int | None:
        ideal = nesting.ideal()
        for end in range(len(ideal), 0, -1):
            t = self._closers.get(ideal[:end])
            if t is not None and m.validate_tokens([t]) == 1:
                return t
        values = ([self._letter] if nesting.in_string and self._letter is not None else [])
        for t in values + self._values:  # NOTE: a letter first extends a too-short string
            if m.validate_tokens([t]) == 1:
                return t
        bits = np.frombuffer(m.compute_bitmask(), dtype="<u4")
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        return next((int(t) for t in allowed if t < self.vocab_size and t not in self._eos),
                    None)

    def _single(self, data: bytes) -> int | None:
        ids = self._tok.tokenize_bytes(data)
        return ids[0] if len(ids) == 1 and ids[0] not in self._eos else None


def nesting_of(closer: Closer, tokens: Sequence[int]) -> Nesting:
    return Nesting().feed(b"".join(closer.token_bytes(t) for t in tokens))
