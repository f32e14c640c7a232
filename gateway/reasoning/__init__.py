"""Reasoning parsers (`--reasoning-parser`, vLLM's names): one file each, registered here."""

from __future__ import annotations

from gateway.reasoning.deepseek_r1 import DeepSeekR1Parser
from gateway.reasoning.deepseek_v3 import DeepSeekV3Parser
from gateway.reasoning.mistral import MistralParser
from gateway.reasoning.qwen3 import Qwen3Parser
from gateway.reasoning.think import ThinkParser

REASONING_PARSERS: dict[str, type[ThinkParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "deepseek_v3": DeepSeekV3Parser,
    "qwen3": Qwen3Parser,
    "mistral": MistralParser,
}
