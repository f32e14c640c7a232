"""Streaming text helpers: token ids to text without splitting characters, and stop strings.

Stdlib only and duck-typed on `tokenizer.decode(ids, skip_special_tokens=...)`, so the gateway
(`tokenizers.Tokenizer`) and the engine (HF tokenizers) share them.
"""

from __future__ import annotations

import functools
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
    The stop that ends the text is the one completed first; of those ending at one place,
    the longest. One automaton (Aho-Corasick) reads each character once, so the cost per
    character does not grow with the number of stop strings.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._automaton = _automaton(tuple(stops)) if stops else None
        self._include = include_stop
        self._state = 0  # the automaton's node: the longest held suffix that starts a stop
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        if self._automaton is None:
            return text, False
        buffer = self._held + text
        step, depth, match = self._automaton.step, self._automaton.depth, self._automaton.match
        state = self._state
        for i, char in enumerate(text):
            state = step(state, char)
            if match[state]:
                end = len(self._held) + i + 1
                start = end - match[state]
                self._stopped, self.matched, self._held = True, buffer[start:end], ""
                return buffer[: end if self._include else start], True
        self._state = state
        keep = depth[state]
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of a stream that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held


class _Automaton:
    """Aho-Corasick over the stop strings: node 0 is the root; `depth[n]` is the length of
    the prefix node n stands for; `match[n]` the length of the longest stop string that
    ends there (0: none)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends = [0]
        for stop in stops:
            node = 0
            for char in stop:
                nxt = self.goto[node].get(char)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][char] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(0)
                node = nxt
            ends[node] = len(stop)
        self.fail = [0] * len(self.goto)
        self.match = list(ends)
        queue = list(self.goto[0].values())
        for node in queue:  # NOTE: breadth first: a node's fail link is shallower than it
            for char, child in self.goto[node].items():
                queue.append(child)
                link = self.fail[node]
                while link and char not in self.goto[link]:
                    link = self.fail[link]
                target = self.goto[link].get(char, 0)
                self.fail[child] = target if target != child else 0
                # NOTE: its own stop is the longest; else the longest one its suffixes end
                self.match[child] = ends[child] or self.match[self.fail[child]]

    def step(self, node: int, char: str) -> int:
        while node and char not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(char, 0)


@functools.lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


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
