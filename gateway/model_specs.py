"""Which models a gateway serves and with which engine options: repeated `--model [NAME=]PATH`,
a `--config` file (TOML, or YAML), and the body of `POST /models/load` all become `ModelSpec`s.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gateway.lora_modules import check_unique_names, modules_option
from ipc.config import EngineConfig
from ipc.model_source import model_name

# NOTE: a spec's own keys beside the engine's options; `model` and `served_model_name` are the
# spec's path and name, so they are not options of their own.
_SPEC_KEYS = ("path", "data_parallel_size")
_OPTIONS = frozenset(f.name for f in fields(EngineConfig)) - {"model", "served_model_name"}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One served model: its API name, its engines' config, and how many engines run it."""

    name: str
    config: EngineConfig  # config.served_model_name is `name`
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"model name {self.name!r} must be non-empty, without spaces "
                             "around it")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")

    @property
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters its engines load at start, in order."""
        return [entry.partition("=")[0] for entry in self.config.lora_modules]


def spec_of(name: str | None, options: Mapping[str, Any], base: EngineConfig,
            data_parallel_size: int = 1) -> ModelSpec:
    """A spec from `options` (`path`, `data_parallel_size` and EngineConfig fields) over the
    `base` config; ValueError names an unknown key or a bad value."""
    for key in options:
        if key not in _OPTIONS and key not in _SPEC_KEYS:
            raise ValueError(f"unknown model option `{key}` (engine options are the serve "
                             "flags' names with underscores, e.g. max_model_len)")
    for key, value in options.items():
        if key != "lora_modules":  # NOTE: checked by modules_option
            _check_type(key, value, _KINDS.get(key, "str | None"))
    path = options.get("path", base.model)
    served = name or model_name(path, base.served_model_name)
    if "lora_modules" in options:  # NOTE: a list of name=path or tables: the engine's tuple
        options = {**options, "lora_modules": modules_option(options["lora_modules"], served)}
    engine = {k: float(v) if _KINDS[k].startswith("float") and v is not None else v
              for k, v in options.items() if k in _OPTIONS}
    config = base.replace(model=path, served_model_name=served, **engine)  # ValueError
    dp = options.get("data_parallel_size", data_parallel_size)
    spec = ModelSpec(name=served, config=config, data_parallel_size=dp)
    try:
        check_unique_names({served: spec.adapters})
    except ValueError as exc:
        raise ValueError(f"`lora_modules`: {exc}") from None
    return spec


# the kind each option's flag parses: "int", "float | None", ... (the fields' annotations)
_KINDS = {f.name: str(f.type) for f in fields(EngineConfig)} | {"data_parallel_size": "int"}
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def _check_type(key: str, value: object, annotation: str) -> None:
    """A file's or a body's value must have the kind the flag would parse (an int for a float
    is fine: JSON and TOML write 1 for 1.0)."""
    kind, _, rest = annotation.partition(" | ")
    if value is None and rest == "None":
        return
    want = _TYPES[kind]
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"model option `{key}` must be {kind}, not {value!r}")


def specs_from_flags(models: list[str], base: EngineConfig,
                     data_parallel_size: int) -> list[ModelSpec]:
    """`--model [NAME=]PATH`, repeated: the CLI's engine flags apply to every model."""
    if len(models) > 1 and base.served_model_name:
        raise ValueError("--served-model-name names one model: with several --model, name "
                         "each as --model NAME=PATH")
    specs = []
    for entry in models:
        name, sep, path = entry.partition("=")
        # NOTE: a path may hold `=`; only a NAME without a path separator counts as a name
        if not sep or "/" in name or not name:
            name, path = "", entry
        specs.append(spec_of(name or None, {"path": path}, base, data_parallel_size))
    return unique(specs)


def specs_from_file(path: Path, base: EngineConfig, data_parallel_size: int) -> list[ModelSpec]:
    """A config file: a `models` table of tables, one per served name, each with `path` and
    engine options (TOML; `.yaml`/`.yml` files hold the same shape in YAML)."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # NOTE: transformers' own dependency; only this format needs it

        data = yaml.safe_load(text)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"--config {path}: needs a `models` table with one table per model")
    specs = []
    for name, options in models.items():
        if not isinstance(options, dict):
            raise ValueError(f"--config {path}: models.{name} must be a table")
        try:
            specs.append(spec_of(str(name), options, base, data_parallel_size))
        except ValueError as exc:
            raise ValueError(f"--config {path}: models.{name}: {exc}") from None
    return unique(specs)


def unique(specs: list[ModelSpec]) -> list[ModelSpec]:
    """`specs`, once no two models share a name and no adapter has another's name."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two models are served as `{spec.name}`: name them apart "
                             "(--model NAME=PATH, or the config file's table names)")
        seen.add(spec.name)
    check_unique_names({spec.name: spec.adapters for spec in specs})
    return specs
