"""The error a grammar ends its request with (no llguidance import: the engine loads it lazily)."""

from __future__ import annotations


class GrammarError(ValueError):
    """llguidance refused the grammar (or it did not compile in time); `param` is the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
