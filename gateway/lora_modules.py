"""Which model each LoRA adapter named at start belongs to: `--lora-modules` entries (vLLM's
`name=path`, or JSON `{"name", "path", "base_model_name"}`), a model's `lora_modules` option
(config file, `/models/load`), and the rule that an adapter's name is unique in the gateway."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str  # a PEFT directory
    base_model_name: str | None = None  # the served model it adapts (None: not said)

    @property
    def entry(self) -> str:
        """The engine's form of it (EngineConfig.lora_modules)."""
        return f"{self.name}={self.path}"


def parse_module(entry: object) -> LoraModule:
    """One entry: `name=path`, JSON text of an object (the flag), or a mapping (a file's or a
    body's table) with `name`, `path` and optional `base_model_name`; ValueError says why."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules: {entry!r} is not JSON ({exc})") from None
    if isinstance(entry, str):
        name, sep, path = entry.partition("=")
        if not (name and sep and path):
            raise ValueError(f"lora_modules: {entry!r} is not name=path (or JSON with name, "
                             "path and base_model_name)")
        return LoraModule(name, path)
    if not isinstance(entry, Mapping):
        raise ValueError(f"lora_modules: {entry!r} is neither name=path nor a table")
    unknown = [k for k in entry if k not in _KEYS]
    if unknown:
        raise ValueError(f"lora_modules: unknown key `{unknown[0]}` (an adapter has "
                         f"{', '.join(_KEYS)})")
    for key in _KEYS:
        value = entry.get(key)
        if key == "base_model_name" and value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"lora_modules: `{key}` must be a non-empty string, not {value!r}")
    return LoraModule(entry["name"], entry["path"], entry.get("base_model_name"))


def modules_option(value: object, model: str) -> tuple[str, ...]:
    """A model's own `lora_modules` option (a list of entries) as the engine's name=path
    tuple; an entry's `base_model_name`, if it says one, must be `model`."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"model option `lora_modules` must be a list, not {value!r}")
    modules = [parse_module(entry) for entry in value]
    for m in modules:
        if m.base_model_name not in (None, model):
            raise ValueError(f"lora_modules: the adapter `{m.name}` names base_model_name "
                             f"`{m.base_model_name}` in the options of the model `{model}`")
    return tuple(m.entry for m in modules)


def modules_by_model(entries: Iterable[str], models: list[str]) -> dict[str, tuple[str, ...]]:
    """`--lora-modules` entries as model name -> its adapters (name=path). With one model an
    entry may leave out `base_model_name`; with several it must say it."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        module = parse_module(entry)
        parent = module.base_model_name
        if parent is None and len(models) > 1:
            raise ValueError(f"--lora-modules {entry}: with several models, say which one the "
                             "adapter is for: '{\"name\": \"" + module.name + "\", \"path\": "
                             "..., \"base_model_name\": MODEL}' (or the model's lora_modules "
                             "in --config)")
        parent = parent or models[0]
        if parent not in models:
            raise ValueError(f"--lora-modules {entry}: base_model_name `{parent}` is not "
                             f"served (the models: {', '.join(models)})")
        out[parent] = (*out.get(parent, ()), module.entry)
    return out


def check_unique_names(adapters: Mapping[str, Iterable[str]]) -> None:
    """`adapters`: model name -> its adapters' names. ValueError naming both holders when an
    adapter has a model's name or another adapter's."""
    holders = {model: f"the model `{model}`" for model in adapters}
    for model, names in adapters.items():
        for name in names:
            if name in holders:
                raise ValueError(f"the adapter `{name}` of the model `{model}` has the name of "
                                 f"{holders[name]}: name them apart")
            holders[name] = f"an adapter of the model `{model}`"
