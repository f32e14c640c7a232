"""DeepSeek-R1 (and its distills): the template opens `<think>`, so all text before `</think>`
is reasoning, with or without a `<think>` of the model's own."""

from __future__ import annotations

from gateway.reasoning.think import ThinkParser


class DeepSeekR1Parser(ThinkParser):
    implicit_start = True
