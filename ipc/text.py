"""Streaming text helpers: token ids to text without splitting characters, and stop strings.

Stdlib only and duck-typed on `tokenizer.decode(ids, skip_special_tokens=...)`, so the gateway
(`tokenizers.Tokenizer`) and the engine (HF tokenizers) share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each `add` decodes a small window (from `_prefix` to the end) and emits what the newest
    tokens added beyond the window's older part (`_prefix:_read`), as vLLM does, so word
    boundaries and leading spaces come out as a full decode would give them. While the
    decoded tail ends in U+FFFD (a character split across tokens) nothing is emitted.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already emitted as text
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return only the new, complete text (maybe "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        """Release any held-back text at the end of the stream (a full decode's remainder)."""
        if self._read == len(self._ids):
            return ""
        emitted = self.text
        full = self._decode(self._ids)
        if full.startswith(emitted):
            delta = full[len(emitted) :]
        else:  # NOTE: a decoder whose text depends on far context; fall back to the window
            delta = self._decode(self._ids[self._prefix :])[
                len(self._decode(self._ids[self._prefix : self._read])) :
            ]
        self._prefix = self._read = len(self._ids)
        if delta:
            self._text.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may start one.

    `push` returns the text that is safe to show now and whether a stop string matched. The
    stop string itself is never emitted unless `include_stop`; nothing is emitted after it.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._include = include_stop
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        found = self._first_match(buffer)
        if found is not None:
            index, stop = found
            self._stopped, self.matched, self._held = True, stop, ""
            end = index + len(stop) if self._include else index
            return buffer[:end], True
        keep = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of a stream that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class ChoiceText:
    """One choice's output tokens to the text its client sees; `LLM.generate` and the gateway
    both use it, so the two front ends give the same text for the same tokens.

    Detokenizes incrementally, holds back and cuts stop strings, and drops the text of the
    stop token that ended the choice (`stop_token_ids`) unless `include_stop_str_in_output`,
    as vLLM does.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stops = StopMatcher(stop, include_stop_str_in_output)
        self._include_stop = include_stop_str_in_output

    @property
    def matched(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self._stops.matched

    def add(self, token_ids: Sequence[int], finished: bool = False,
            stop_token: bool = False) -> tuple[str, bool]:
        """Consume one delta's tokens (`stop_token`: its last one is the stop token that
        ended it); returns the text safe to show now and whether a stop string matched
        (nothing follows it then)."""
        if stop_token and not self._include_stop:
            token_ids = token_ids[:-1]
        text = self._detok.add(token_ids)
        if finished:
            text += self._detok.flush()
        safe, stopped = self._stops.push(text)
        if not stopped and finished:
            safe += self._stops.flush()
        return safe, stopped
