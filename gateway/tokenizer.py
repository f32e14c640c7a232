"""The gateway's tokenizer: `tokenizers` for ids, jinja2 for chat templates (no transformers/torch).

Reads an HF tokenizer directory: tokenizer.json, tokenizer_config.json and, as transformers 5
saves it, chat_template.jinja. Templates render as HF renders them (sandboxed jinja2,
trim_blocks/lstrip_blocks, `raise_exception`). Special-token strings in client text become
control tokens, as in HF, unless `split_special_tokens` encodes client text as plain text.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import ApiError

_REQUEST_TEMPLATES = 16  # per-request chat templates kept compiled


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

    def __init__(self, directory: str | Path, chat_template: str | None = None) -> None:
        """chat_template: a template's text, instead of the tokenizer's own (--chat-template)."""
        directory = Path(directory)
        self.directory = directory
        self._tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        source = chat_template or _template_source(directory, config)
        self._env = _environment()
        self._template = self._env.from_string(source) if source else None
        self.template_source = source or None
        self._variables = self._read_variables(source) if source else frozenset()
        # NOTE: a template that reads `tools` renders them itself (e.g. Qwen2.5's Hermes block)
        self.has_tools_branch = "tools" in self._variables
        self._request_templates: OrderedDict[str, tuple[jinja2.Template, frozenset[str]]] = (
            OrderedDict())
        # NOTE: a second instance, as `encode_special_tokens` is a setting of the whole object
        # and encodes may run on several threads at once.
        self._plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._plain.encode_special_tokens = True
        # NOTE: vocabulary keys are at least as long as the text of their token (byte-level
        # BPE writes each byte as one symbol), so this bounds characters per token from above.
        self.max_token_chars = max(len(k) for k in self._tok.get_vocab(with_added_tokens=True))

    def _read_variables(self, source: str) -> frozenset[str]:
        return frozenset(jinja2.meta.find_undeclared_variables(self._env.parse(source)))

    def _compiled(self, chat_template: str | None) -> tuple[jinja2.Template | None,
                                                             frozenset[str]]:
        """The template and the variables it reads: the tokenizer's own, or a request's
        (vLLM's per-request `chat_template`), compiled once (a small LRU)."""
        if chat_template is None:
            return self._template, self._variables
        cached = self._request_templates.get(chat_template)
        if cached is None:
            try:
                cached = (self._env.from_string(chat_template),
                          self._read_variables(chat_template))
            except jinja2.TemplateError as exc:
                raise ApiError(400, f"chat_template does not compile: {exc}",
                               "invalid_chat_template", "chat_template") from None
            self._request_templates[chat_template] = cached
            if len(self._request_templates) > _REQUEST_TEMPLATES:
                self._request_templates.popitem(last=False)
        self._request_templates.move_to_end(chat_template)
        return cached

    def reads(self, variable: str, chat_template: str | None = None) -> bool:
        """Whether the chat template (the request's, else the tokenizer's) reads `variable`."""
        return variable in self._compiled(chat_template)[1]

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when it is one special added token (as a template writes it)."""
        for token_id, added in self._tok.get_added_tokens_decoder().items():
            if added.content == text and added.special:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False,
               split_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; `split_special_tokens` encodes special-token strings as plain text."""
        tok = self._plain if split_special_tokens else self._tok
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str, split_special_tokens: bool = False
                    ) -> list[int]:
        """Ids of a text pair, with the special tokens of the tokenizer's pair template: the
        text-pair call `tokenizer(first, second)` (sentence-transformers' CrossEncoder)."""
        tok = self._plain if split_special_tokens else self._tok
        return tok.encode(first, second, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, as OpenAI's logprobs show it (invalid UTF-8 shown as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
    ) -> str:
        """The rendered conversation. `continue_final_message`: end the text right after the
        last message's content (no end-of-turn), so the model continues that message;
        `template_kwargs` are extra variables for the template (vLLM's chat_template_kwargs);
        `chat_template`: the request's own template instead of the tokenizer's."""
        template = self._compiled(chat_template)[0]
        if template is None:
            raise ApiError(
                400, "this model's tokenizer has no chat template (a base model?): use "
                "/v1/completions, or start the server with --chat-template FILE",
                "chat_template_missing", "messages",
            )
        try:
            text = template.render(
                **(template_kwargs or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from None
        if not continue_final_message:
            return text
        final = str(messages[-1].get("content") or "").strip() if messages else ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ApiError(400, "continue_final_message needs a final message with content "
                           "that the template writes out", "invalid_value",
                           "continue_final_message")
        return text[: end + len(final)]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
        split_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None, add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes its own special tokens;
        `add_special_tokens` adds the tokenizer's too, e.g. a BOS, as vLLM's flag does);
        `split_special_tokens` encodes the messages' contents as plain text."""
        render = functools.partial(self.render_chat, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   template_kwargs=template_kwargs, tools=tools,
                                   chat_template=chat_template)
        text = render(messages)
        if not split_special_tokens:
            return self.encode(text, add_special_tokens)
        ids: list[int] = []
        for piece, plain in self._segments(messages, render, text):
            ids += self.encode(piece, split_special_tokens=plain)
        if add_special_tokens:  # NOTE: the tokenizer's own additions, around the whole text
            prefix, suffix = self._added_around()
            ids = prefix + ids + suffix
        return ids

    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids `add_special_tokens` puts before and after a text (e.g. a BOS)."""
        plain = self._tok.encode("\ue000", add_special_tokens=False).ids
        added = self._tok.encode("\ue000", add_special_tokens=True).ids
        for i in range(len(added) - len(plain) + 1):
            if added[i : i + len(plain)] == plain:
                return added[:i], added[i + len(plain):]
        return [], []

    def _segments(self, messages: list[dict[str, Any]], render: Callable[[list], str],
                  text: str) -> list[tuple[str, bool]]:
        """`text` cut into (template text, False) and (message content, True) pieces.

        The template is rendered again with a marker in place of each content; the cut is
        used only if putting the contents back gives `text` exactly (a template that edits
        contents, say with `trim`, is tried with stripped contents, else refused)."""
        contents = [m.get("content") for m in messages]
        marked = [{**m, "content": f"\ue000{i}\ue001"} if isinstance(m.get("content"), str)
                  else m for i, m in enumerate(messages)]
        skeleton = re.split("\ue000(\\d+)\ue001", render(marked))
        for edit in (lambda c: c, str.strip):
            pieces = [(part, False) if k % 2 == 0 else (edit(contents[int(part)]), True)
                      for k, part in enumerate(skeleton)]
            if "".join(p for p, _ in pieces) == text:
                return [p for p in pieces if p[0]]
        raise ApiError(400, "this chat template changes message contents, so they cannot be "
                       "encoded apart from it (--split-special-tokens)",
                       "invalid_chat_template", "messages")


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
