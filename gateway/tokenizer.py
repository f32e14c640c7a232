"""The gateway's tokenizer: `tokenizers` for ids, jinja2 for chat templates (no transformers/torch).

Reads an HF tokenizer directory: tokenizer.json, tokenizer_config.json and, as transformers 5
saves it, chat_template.jinja. Templates render as HF renders them (sandboxed jinja2,
trim_blocks/lstrip_blocks, `raise_exception`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import ApiError


class TemplateError(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(400, f"chat template: {message}", "invalid_chat_template", "messages")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode with `tokenizers` and render the chat template of one tokenizer directory."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.directory = directory
        self._tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        source = _template_source(directory, config)
        env = _environment()
        self._template = env.from_string(source) if source else None
        # NOTE: a template that reads `tools` renders them itself (e.g. Qwen2.5's Hermes block)
        self.has_tools_branch = bool(source) and "tools" in jinja2.meta.find_undeclared_variables(
            env.parse(source))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, as OpenAI's logprobs show it (invalid UTF-8 shown as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            raise ApiError(
                400, "this model's tokenizer has no chat template; use /v1/completions",
                "chat_template_missing", "messages",
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))


def _template_source(directory: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    path = directory / "chat_template.jinja"
    return path.read_text() if path.is_file() else None


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
