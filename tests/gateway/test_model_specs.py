"""Which models `pagedserve serve` is told to serve: repeated `--model [NAME=]PATH`, a TOML or
YAML `--config`, and the errors that name the flag or option at fault; the registry's name
lookup (default model, adapters served by their parent's engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, check_args
from gateway.model_registry import ModelRegistry, UnknownModelError
from gateway.model_specs import spec_of, specs_from_file

TOML = """
[models.alpha]
path = "/models/a"
data_parallel_size = 2
max_model_len = 512

[models."beta-1.5"]
path = "/models/b.gguf"
kv_cache_space = 2
quantization = "gguf"
"""

YAML = """
models:
  alpha: {path: /models/a, data_parallel_size: 2, max_model_len: 512}
  beta-1.5: {path: /models/b.gguf, kv_cache_space: 2, quantization: gguf}
"""


def _checked(*argv: str):
    ns = build_parser().parse_args(["serve", *argv])
    check_args(ns)
    return ns


def test_one_model_keeps_the_one_engine_path() -> None:
    ns = _checked("--model", "/models/a", "--served-model-name", "a")
    assert not ns.several_models
    assert (ns.model, ns.served_model_name) == ("/models/a", "a")
    named = _checked("--model", "tiny=/models/a")
    assert (named.model, named.served_model_name) == ("/models/a", "tiny")
    bundled = _checked()
    assert bundled.model is None and bundled.model_specs[0].name == "SmolLM2-135M-Instruct"


def test_repeated_model_flags_name_each_model() -> None:
    ns = _checked("--model", "/models/a", "--model", "b=/models/x.gguf", "--max-model-len",
                  "256", "--data-parallel-size", "2")
    assert ns.several_models and ns.model is None
    specs = {s.name: s for s in ns.model_specs}
    assert set(specs) == {"a", "b"}
    assert specs["b"].config.model == "/models/x.gguf"
    assert specs["b"].config.served_model_name == "b"
    # the flags' engine options apply to every model
    assert {s.config.max_model_len for s in specs.values()} == {256}
    assert {s.data_parallel_size for s in specs.values()} == {2}


@pytest.mark.parametrize("text,suffix", [(TOML, ".toml"), (YAML, ".yaml")])
def test_config_file_gives_each_model_its_options(tmp_path: Path, text: str,
                                                  suffix: str) -> None:
    path = tmp_path / f"models{suffix}"
    path.write_text(text)
    ns = _checked("--config", str(path), "--max-model-len", "1024", "--num-threads", "1")
    alpha, beta = ns.model_specs
    assert (alpha.name, alpha.data_parallel_size, alpha.config.max_model_len) == \
        ("alpha", 2, 512)
    assert (beta.name, beta.data_parallel_size, beta.config.max_model_len) == \
        ("beta-1.5", 1, 1024)
    assert beta.config.kv_cache_space == 2.0 and isinstance(beta.config.kv_cache_space, float)
    assert beta.config.quantization == "gguf"
    assert {alpha.config.num_threads, beta.config.num_threads} == {1}
    # the spec travels to the engine as flags: its served name is the table's name
    assert "--served-model-name" in beta.config.to_cli_args()


@pytest.mark.parametrize("argv,message", [
    (["--model", "/a", "--model", "/b/a"], "two models are served as `a`"),
    (["--model", "/a", "--model", "/b", "--served-model-name", "x"], "--served-model-name"),
    (["--model", "/a", "--model", "/b", "--attach-engine", "--engine-input-addr", "tcp://x:1",
      "--engine-output-addr", "tcp://x:2"], "--attach-engine"),
    (["--config", "/nonexistent.toml"], "--config"),
])
def test_flag_errors_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _checked(*argv)


@pytest.mark.parametrize("options,message", [
    ({"path": "/a", "max_model_len": "long"}, "`max_model_len` must be int"),
    ({"path": "/a", "enable_prefix_caching": 1}, "`enable_prefix_caching` must be bool"),
    ({"path": "/a", "max_model_len": 0}, "max_model_len must be >= 1"),
    ({"path": "/a", "dtype": "float8"}, "dtype must be one of"),
    ({"path": "/a", "nope": 1}, "unknown model option `nope`"),
    ({"path": "/a", "data_parallel_size": 0}, "data_parallel_size must be >= 1"),
    ({"path": 7}, "`path` must be str"),
])
def test_bad_options_name_the_option(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_of("m", options, build_config())


def test_config_file_errors_say_where(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[models.a]\npath = "/a"\nmax_num_seqs = -1\n')
    with pytest.raises(ValueError, match=r"m.toml: models.a: max_num_seqs must be >= 1"):
        specs_from_file(path, build_config(), 1)
    path.write_text("[other]\n")
    with pytest.raises(ValueError, match="needs a `models` table"):
        specs_from_file(path, build_config(), 1)
    path.write_text("[models.a\n")
    with pytest.raises(ValueError, match="m.toml"):
        specs_from_file(path, build_config(), 1)


def build_config():
    from ipc.config import EngineConfig

    return EngineConfig()


class _Engines:
    """Stands in for an engine client: the registry only stores it here."""

    def __init__(self, spec) -> None:
        self.spec = spec


def test_registry_resolves_names_default_and_adapters() -> None:
    specs = [spec_of("a", {"path": "/a"}, build_config()),
             spec_of("b", {"path": "/b"}, build_config())]
    registry = ModelRegistry(specs, _Engines)  # type: ignore[arg-type]
    assert registry.resolve(None).name == "a" and registry.resolve("").name == "a"
    assert registry.resolve("b").name == "b"
    with pytest.raises(UnknownModelError):
        registry.resolve("c")
    registry.add_alias("b-lora", "b")  # an adapter: its requests go to b's engines
    assert registry.resolve("b-lora").engines is registry.resolve("b").engines
    with pytest.raises(ValueError):
        registry.add_alias("a", "b")
    with pytest.raises(UnknownModelError):
        registry.add_alias("x-lora", "x")
    registry.remove_alias("b-lora")
    with pytest.raises(UnknownModelError):
        registry.resolve("b-lora")
