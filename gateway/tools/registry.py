"""The tool-call formats by name (`--tool-call-parser`), `auto`'s pick from a chat template, and
the format a tokenizer writes calls in (`CallSyntax`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.tools.format import ToolFormat
from gateway.tools.hermes import HermesFormat
from gateway.tools.llama3_json import Llama3JsonFormat
from gateway.tools.mistral import MistralFormat

# NOTE: in the order `auto` tries them (Mistral's templates may mention Hermes' tag too);
# a new format is one line here
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    MistralFormat(),
    HermesFormat(),
    Llama3JsonFormat(),
)}
PARSERS = ("auto", *sorted(FORMATS))  # --tool-call-parser's choices
FALLBACK = "hermes"  # the fallback prompt's format, for templates without a tools branch


def detect_parser(template: str | None, tools_branch: bool) -> str:
    """The format `auto` stands for: the one the template's tools branch writes calls in;
    Hermes (the fallback prompt's) when it has none or none is recognised."""
    if not template or not tools_branch:
        return FALLBACK
    return next((name for name, f in FORMATS.items() if f.detects(template)), FALLBACK)


def format_for(name: str) -> ToolFormat:
    """The format of a resolved parser name (not `auto`)."""
    if name not in FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class CallSyntax:
    """How the request's tool-call format is written with this tokenizer: the format's name,
    and the Lark of its opening and closing when the tokenizer has each as one special token
    (`<[id]>`), else None: the literal text."""

    parser: str = FALLBACK
    special_opening: str | None = None
    special_closing: str | None = None

    @property
    def format(self) -> ToolFormat:
        return format_for(self.parser)

    @property
    def opening(self) -> str:
        """The opening as a Lark term (the special token, or the quoted text)."""
        text = self.format.opening
        assert text is not None, f"{self.parser} has no opening"
        return self.special_opening or json.dumps(text)
