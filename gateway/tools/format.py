"""A tool-call format: how calls open and close, their arguments key, whether a chat template
writes them, how a prompt shows them, the Lark framing of their grammar, and their parser."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from gateway.tools.parsing import CallParser


class CallSyntax(Protocol):
    """What a format's grammar reads of registry.CallSyntax (a Protocol here, so that the
    formats need not import the registry that lists them)."""

    special_opening: str | None
    special_closing: str | None

    @property
    def opening(self) -> str: ...


class ToolFormat:
    """One format (vLLM's `--tool-call-parser` names). A new format is a subclass in its own
    file and one line in gateway/tools/registry.py FORMATS.

    Grammar methods read the opening and closing from the `CallSyntax`: a special token
    (`<[id]>`) when the tokenizer has one for it, else the quoted text.
    """

    name: ClassVar[str]
    opening: ClassVar[str | None]  # the text that starts calls; None: a reply that is calls
    closing: ClassVar[str | None] = None  # the text after each call, if any
    args_key: ClassVar[str] = "arguments"  # the call object's key for the arguments
    parser: ClassVar[type[CallParser]]  # the streaming parser (one per choice)
    example: ClassVar[str]  # the fallback prompt's one call, with placeholders
    wrapping: ClassVar[str]  # the fallback prompt's words for where calls go
    # NOTE: True when several calls share one opening (Mistral's array); False when each call
    # carries its own (Hermes' tags): `auto` then repeats opening and call as a whole
    joins_calls: ClassVar[bool] = True

    def detects(self, template: str) -> bool:
        """Whether a chat template's tools branch writes calls in this format."""
        raise NotImplementedError

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments) written as the model writes them."""
        raise NotImplementedError

    def call_properties(self) -> dict[str, Any]:
        """JSON Schema properties a call object may carry beside name and arguments."""
        return {}

    def calls_rule(self, parallel: bool, syntax: CallSyntax) -> str:
        """The Lark rule `calls`: what follows the opening, one `body` (a call's JSON) or
        several (`parallel`)."""
        raise NotImplementedError

    def forced_start(self, syntax: CallSyntax) -> str:
        """The Lark `start` of a reply that must be calls (tool_choice required or named)."""
        return f"start: {syntax.opening} calls"

    def auto_grammar(self, rules: str, parallel: bool, syntax: CallSyntax) -> str:
        """`tool_choice: auto` with strict tools: any text, or calls; once a call's opening
        is written the rest of it must match (`rules`: the `calls` and `body` rules).

        NOTE: an opening that is plain text ends a lazy lexeme (llguidance's tool-calling
        recipe): free text runs until the opening's first appearance, which then commits to
        a call.
        """
        if syntax.special_opening is not None:
            lead = f"lead: TEXT {syntax.special_opening}\n"
        else:
            lead = f"lead[lazy]: TEXT {syntax.opening}\n"
        start = "start: (lead calls)* TEXT" if parallel else "start: TEXT | lead calls"
        return f"%llguidance {{}}\n{start}\n{lead}TEXT: /(.|\\n)*/\n{rules}"
