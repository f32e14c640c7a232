"""Mistral's reasoning models (Magistral): `[THINK]...[/THINK]`; a reply without `[THINK]` is
all answer (vLLM's `mistral`)."""

from __future__ import annotations

from gateway.reasoning.think import ThinkParser


class MistralParser(ThinkParser):
    start = "[THINK]"
    end = "[/THINK]"
    implicit_start = False
