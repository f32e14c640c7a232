"""Qwen3: reasoning only inside a `<think>...</think>` the model writes (or the template opens);
`enable_thinking: false` makes the template write an empty block, so nothing is reasoning."""

from __future__ import annotations

from gateway.reasoning.think import ThinkParser


class Qwen3Parser(ThinkParser):
    implicit_start = False
