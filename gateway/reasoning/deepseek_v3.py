"""DeepSeek-V3.1 and later: they reason only when asked (`chat_template_kwargs: {"thinking":
true}`), then as DeepSeek-R1; otherwise the reply is all answer (vLLM's `deepseek_v3`)."""

from __future__ import annotations

from typing import Any

from gateway.reasoning.deepseek_r1 import DeepSeekR1Parser


class DeepSeekV3Parser(DeepSeekR1Parser):
    @classmethod
    def thinks(cls, template_kwargs: dict[str, Any]) -> bool:
        return bool(template_kwargs.get("thinking") or template_kwargs.get("enable_thinking"))
