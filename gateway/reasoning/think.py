"""The `<think>...</think>` split every reasoning parser shares: a streaming state machine over
the reply's text (markers held back across chunk boundaries) and a count of reasoning tokens."""

from __future__ import annotations

import json
from typing import Any, ClassVar

BEFORE, REASONING, ANSWER = "before", "reasoning", "answer"


class ThinkParser:
    """Splits one reply into (reasoning, answer) as it streams.

    The mode at the reply's start comes from the prompt's end: a prompt that ends with the
    end marker (Qwen3's `enable_thinking: false` writes an empty `<think></think>`) leaves
    nothing to reason; one that ends with the start marker (DeepSeek-R1's template) is
    reasoning from the first token. Otherwise `implicit_start` decides: reasoning from the
    first token (a start marker written anyway is dropped), or answer text until the model
    writes the start marker.
    """

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def __init__(self, prompt_tail: str = "", start_id: int | None = None,
                 end_id: int | None = None) -> None:
        """prompt_tail: the end of the prompt's text; start_id / end_id: the markers' token
        ids when each is one token (reasoning tokens are then counted exactly)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            self._mode = ANSWER
        elif tail.endswith(self.start) or self.implicit_start:
            self._mode = REASONING
        else:
            self._mode = BEFORE
        # NOTE: reasoning that began without its marker drops a start marker written anyway
        self._drop_start = self._mode == REASONING
        self._held = ""
        self._ids = (start_id, end_id) if start_id is not None and end_id is not None else None
        self._id_mode, self._id_drop = self._mode, self._drop_start
        self._last_reasoning_only = False

    @classmethod
    def thinks(cls, template_kwargs: dict[str, Any]) -> bool:
        """Whether requests with these chat_template_kwargs can reason at all."""
        return True

    @property
    def reasoning_ended(self) -> bool:
        """The answer has begun (what the grammar of the answer waits for)."""
        return self._mode == ANSWER

    def grammar(self, special: bool = False) -> str | None:
        """A Lark grammar of the reasoning this reply may start with, then `@answer` (the
        request's grammar, which applies from the end marker on, as vLLM applies it); None
        when the prompt already ended the reasoning. `special`: the markers are special
        tokens (written `<[id]>`; free text cannot contain them)."""
        if self._mode == ANSWER:
            return None
        if special and self._ids is not None:
            start, end = (f"<[{i}]>" for i in self._ids)
            body = f"think_body: THINK_TEXT {end}\nTHINK_TEXT: /(.|\\n)*/\n"
        else:
            start, end = json.dumps(self.start), json.dumps(self.end)
            # NOTE: a lazy lexeme ends at the marker's first appearance, as the parser does
            body = f"think_body[lazy]: /(.|\\n)*/ {end}\n"
        if self._mode == REASONING:
            return f"start: think_body @answer\n{body}"
        return f"start: think? @answer\nthink: {start} think_body\n{body}"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        answer: list[str] = []
        while buf:
            if self._mode == ANSWER:
                answer.append(buf)
                break
            if self._mode == BEFORE:
                i = buf.find(self.start)
                if i >= 0:
                    answer.append(buf[:i])
                    buf, self._mode = buf[i + len(self.start):], REASONING
                    continue
                keep = 0 if final else _partial(buf, self.start)
                answer.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            i_end = buf.find(self.end)
            i_start = buf.find(self.start) if self._drop_start else -1
            if i_start >= 0 and (i_end < 0 or i_start < i_end):
                reasoning.append(buf[:i_start])
                buf, self._drop_start = buf[i_start + len(self.start):], False
                continue
            if i_end >= 0:
                reasoning.append(buf[:i_end])
                buf, self._mode = buf[i_end + len(self.end):], ANSWER
                continue
            keep = 0 if final else max(_partial(buf, self.end),
                                       _partial(buf, self.start) if self._drop_start else 0)
            reasoning.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            break
        r, a = "".join(reasoning), "".join(answer)
        self._last_reasoning_only = self._mode == REASONING and not a
        return r, a

    def count(self, token_ids: list[int]) -> int:
        """Tokens strictly between the markers (as vLLM counts them). Without single-token
        markers: the tokens of pieces whose text was all reasoning."""
        if self._ids is None:
            return len(token_ids) if self._last_reasoning_only else 0
        start_id, end_id = self._ids
        n = 0
        for t in token_ids:
            if self._id_mode == ANSWER:
                break
            if t == end_id and self._id_mode == REASONING:
                self._id_mode = ANSWER
            elif t == start_id and (self._id_mode == BEFORE or self._id_drop):
                self._id_mode, self._id_drop = REASONING, False
            elif self._id_mode == REASONING:
                n += 1
        return n


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and is not all of it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
