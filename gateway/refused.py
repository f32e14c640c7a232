"""Request fields that would change generation but are not implemented: a 400 naming the
field, never a silent ignore. Edit `REFUSED_FIELDS` when one becomes supported.

Fields that change nothing here (`user`, `metadata`, `store`, ...) are accepted: see
`gateway.requests._Common`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gateway.errors import ApiError

_GUIDED = ("was removed in vLLM; use `structured_outputs` (json, regex, choice, grammar, "
           "whitespace_pattern)")

# field name -> why it is refused (the message says "`<field>` <why>")
REFUSED_FIELDS: dict[str, str] = {
    "functions": "is not supported: use `tools` (the legacy functions API is not)",
    "function_call": "is not supported: use `tool_choice`",
    "suffix": "is not supported (insertion needs a fill-in-the-middle model)",
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED,
    "guided_whitespace_pattern": _GUIDED,
    "prediction": "is not supported (predicted outputs)",
    "audio": "is not supported: the model has no audio output",
    "modalities": "is not supported: text is the only modality",
    "bad_words": "is not supported",
    "allowed_token_ids": "is not supported",
    "truncate_prompt_tokens": "is not supported: prompts are never truncated",
    "prompt_embeds": "is not supported",
    "logits_processors": "is not supported: the server runs no custom logits processors",
    "vllm_xargs": "is not supported: the server runs no custom logits processors that read it",
    "mm_processor_kwargs": "is not supported: the model takes text only",
}

# tool calling is a chat feature: /v1/completions refuses these too
CHAT_ONLY_FIELDS: dict[str, str] = {
    name: "is only supported on /v1/chat/completions"
    for name in ("tools", "tool_choice", "parallel_tool_calls")
}

# NOTE: values that ask for nothing (clients often send them as defaults) are not refused;
# a guided_* field asks for something unless it is null (`guided_json: {}` is a schema)
_EMPTY = (b"null", b"[]", b"{}", b'""', b"false")
_NULL = (b"null",)

_Refused = msgspec.defstruct(
    "_Refused", [(name, msgspec.Raw, msgspec.Raw(b"null"))
                 for name in {**REFUSED_FIELDS, **CHAT_ONLY_FIELDS}])
_decoder = msgspec.json.Decoder(_Refused)


def check_refused(body: bytes, chat: bool = True) -> None:
    """Raise a 400 for the first refused field the (already valid JSON object) body sets;
    `chat`: the body is a chat completions request (else CHAT_ONLY_FIELDS are refused too)."""
    fields = _decoder.decode(body)
    table = REFUSED_FIELDS if chat else {**REFUSED_FIELDS, **CHAT_ONLY_FIELDS}
    for name, why in table.items():
        empty = _NULL if name.startswith("guided_") else _EMPTY
        if bytes(getattr(fields, name)).strip() not in empty:
            raise ApiError(400, f"`{name}` {why}", "unsupported_parameter", name)


def refusal_check(table: dict[str, str]) -> Callable[[bytes], None]:
    """A check like `check_refused` for another route's table (field name -> why): raises a
    400 naming the first field of `table` the (valid JSON object) body sets."""
    decoder = msgspec.json.Decoder(msgspec.defstruct(
        "_RouteRefused", [(name, msgspec.Raw, msgspec.Raw(b"null")) for name in table]))

    def check(body: bytes) -> None:
        fields = decoder.decode(body)
        for name, why in table.items():
            if bytes(getattr(fields, name)).strip() not in _EMPTY:
                raise ApiError(400, f"`{name}` {why}", "unsupported_parameter", name)

    return check
