"""The scheduler's LoRA rule (no torch): the running requests use at most max_loras distinct
adapters, so that every step's adapters fit the runner's slots."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class HasLora(Protocol):
    lora_id: int | None


def lora_fits(candidate: HasLora, running: Iterable[HasLora], max_loras: int | None) -> bool:
    """Whether `candidate` may join `running` (max_loras None: LoRA is off, no cap)."""
    if candidate.lora_id is None or max_loras is None:
        return True
    active = {r.lora_id for r in running if r.lora_id is not None}
    return candidate.lora_id in active or len(active) < max_loras

