"""`pagedserve serve`'s model flags (`--model` repeated, `--config`, run-time management) and the
engines they start: one engine client or pool for one model, a ModelRegistry for several."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from gateway.engine_client import EngineClient
from gateway.engine_pool import EnginePool
from gateway.lora_modules import modules_by_model
from gateway.model_registry import Engines, ModelRegistry
from gateway.model_specs import ModelSpec, spec_of, specs_from_file, specs_from_flags, unique
from ipc.config import config_from_args
from ipc.model_source import model_name

log = logging.getLogger("gateway.model_args")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models (README: Several models)")
    group.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                       help="HF model directory or .gguf file, or gemma3-270m (the gemma3 "
                            "extra); repeat it to serve several models, each under NAME (or "
                            "the file's name), with the engine flags below (default: the "
                            "bundled SmolLM2-135M)")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="a TOML (or .yaml) file with a `models` table: one table per "
                            "served name with `path`, `data_parallel_size` and engine options "
                            "(max_model_len, dtype, quantization...) over the flags' values")
    group.add_argument("--enable-model-management", action="store_true",
                       help="allow POST /models/load and /models/unload (guarded by "
                            "--api-key when one is set)")


def check_model_args(ns: argparse.Namespace) -> None:
    """Build `ns.model_specs` (ValueError names the flag); `ns.model` becomes the one model's
    path again, for the flags and configs that read it."""
    entries: list[str] = ns.model or []
    ns.model = None
    # NOTE: the flag's adapters belong to the model each names, not to every model's engines
    adapters, ns.lora_modules = list(ns.lora_modules), []
    base = config_from_args(ns)
    if ns.config is not None:
        if entries:
            raise ValueError("--config names the models: drop --model")
        if not Path(ns.config).is_file():
            raise ValueError(f"--config {ns.config!r} is not a file")
        specs = specs_from_file(Path(ns.config), base, ns.data_parallel_size)
    elif entries:
        specs = specs_from_flags(entries, base, ns.data_parallel_size)
    else:
        specs = [spec_of(None, {}, base, ns.data_parallel_size)]
    specs = _with_flag_adapters(specs, adapters)
    ns.model_specs, ns.model_base = specs, base
    ns.several_models = ns.config is not None or len(specs) > 1 or ns.enable_model_management
    if not ns.several_models:
        ns.model = specs[0].config.model
        ns.lora_modules = list(specs[0].config.lora_modules)
        if specs[0].name != model_name(ns.model, ns.served_model_name):  # NOTE: NAME=PATH
            ns.served_model_name = specs[0].name
        return
    if ns.attach_engine or ns.engine_input_addr or ns.engine_output_addr:
        raise ValueError("--attach-engine and --engine-*-addr serve one model: with several "
                         "(or --enable-model-management) each gets its own sockets")
    if ns.nnodes > 1 or ns.headless:
        raise ValueError("--nnodes > 1 serves one model (start one server per model)")
    if ns.enable_model_management and not ns.api_key:
        log.warning("--enable-model-management without --api-key: anyone who reaches the "
                    "port can load and unload models")


def _with_flag_adapters(specs: list[ModelSpec], entries: list[str]) -> list[ModelSpec]:
    """`specs` with `--lora-modules`' adapters added to the models they name (ValueError
    names the entry, or the model whose engines run without LoRA)."""
    owned = modules_by_model(entries, [s.name for s in specs])
    out = []
    for spec in specs:
        if spec.name in owned and not spec.config.enable_lora:
            raise ValueError(f"--lora-modules: the model `{spec.name}` runs without LoRA: add "
                             "--enable-lora (or enable_lora = true in its --config table)")
        modules = spec.config.lora_modules + owned.get(spec.name, ())
        out.append(replace(spec, config=spec.config.replace(lora_modules=modules)))
    return unique(out)


def engines_for(ns: argparse.Namespace) -> Engines | ModelRegistry:
    """What serves the models of checked args: one model's client or pool, or a registry."""
    if not ns.several_models:
        return _engines(ns, ns.model_specs[0], attach=ns.attach_engine)
    return ModelRegistry(ns.model_specs, lambda spec: _engines(ns, spec, attach=False),
                         ns.model_base)


def _engines(ns: argparse.Namespace, spec: ModelSpec, *, attach: bool) -> Engines:
    opts = dict(heartbeat_timeout=ns.engine_heartbeat_timeout,
                startup_timeout=ns.engine_startup_timeout, spawn=not attach,
                input_addr=ns.engine_input_addr, output_addr=ns.engine_output_addr)
    if spec.data_parallel_size > 1:
        return EnginePool(spec.config, size=spec.data_parallel_size, **opts)  # type: ignore[arg-type]
    return EngineClient(spec.config, **opts)  # type: ignore[arg-type]
