"""Which models `pagedserve serve` is told to serve: repeated `--model [NAME=]PATH`, a TOML or
YAML `--config`, and the errors that name the flag or option at fault; the registry's name
lookup (default model, adapters served by their parent's engines); LoRA adapters given to the
model they name, their names unique across the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.cli import build_parser, check_args
from gateway.model_registry import ModelRegistry, NameTakenError, UnknownModelError
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
    ({"path": "/a", "lora_modules": ["x=/x"]}, "lora_modules needs enable_lora"),
    ({"path": "/a", "enable_lora": True, "lora_modules": "x=/x"}, "must be a list"),
    ({"path": "/a", "enable_lora": True, "lora_modules": ["x=/x", "x=/y"]},
     "`lora_modules`: the adapter `x` of the model `m` has the name of an adapter"),
    ({"path": "/a", "enable_lora": True, "lora_modules": [{"name": "x", "path": "/x",
                                                           "base_model_name": "n"}]},
     "names base_model_name `n`"),
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
    lora = {"enable_lora": True, "lora_modules": ["b-lora=/adapters/b"]}
    specs = [spec_of("a", {"path": "/a"}, build_config()),
             spec_of("b", {"path": "/b", **lora}, build_config())]
    registry = ModelRegistry(specs, _Engines)  # type: ignore[arg-type]
    assert registry.resolve(None).name == "a" and registry.resolve("").name == "a"
    assert registry.resolve("b").name == "b"
    with pytest.raises(UnknownModelError):
        registry.resolve("c")
    # an adapter: its requests go to b's engines
    assert registry.resolve("b-lora").engines is registry.resolve("b").engines
    assert registry.holder("b-lora") == "an adapter of the model `b`"
    adapter = {"path": "/c", "enable_lora": True}
    for name, options, param, words in [
            ("b-lora", {"path": "/c"}, "model",
             "the model `b-lora` has the name of an adapter of the model `b`"),
            ("c", {**adapter, "lora_modules": [{"name": "b-lora", "path": "/x"}]},
             "lora_modules", "the adapter `b-lora` of the model `c` has the name of an adapter "
             "of the model `b`"),
            ("c", {**adapter, "lora_modules": ["a=/x"]}, "lora_modules",
             "has the name of the model `a`")]:
        with pytest.raises(NameTakenError) as taken:
            asyncio.run(registry.load(spec_of(name, options, build_config())))
        assert (taken.value.param, words in str(taken.value)) == (param, True), str(taken.value)


def test_lora_modules_belong_to_the_model_they_name(tmp_path: Path) -> None:
    entry = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "b"}'
    ns = _checked("--model", "/models/a", "--model", "/models/b", "--enable-lora",
                  "--lora-modules", entry, "--max-loras", "2")
    assert [(s.name, s.config.lora_modules, s.config.max_loras) for s in ns.model_specs] == \
        [("a", (), 2), ("b", ("sql=/adapters/sql",), 2)]
    one = _checked("--model", "/models/a", "--enable-lora", "--lora-modules", "x=/x",
                   '{"name": "y", "path": "/y"}')
    assert one.model_specs[0].config.lora_modules == ("x=/x", "y=/y") == tuple(one.lora_modules)
    path = tmp_path / "m.toml"  # each model's own LoRA options, and the flag's adapter for b
    path.write_text('[models.a]\npath = "/a"\nenable_lora = true\nmax_loras = 3\n'
                    'lora_modules = ["x=/x", {name = "y", path = "/y"}]\n\n'
                    '[models.b]\npath = "/b"\nenable_lora = true\n')
    ns = _checked("--config", str(path), "--lora-modules", entry)
    assert [(s.name, s.config.lora_modules, s.config.max_loras) for s in ns.model_specs] == \
        [("a", ("x=/x", "y=/y"), 3), ("b", ("sql=/adapters/sql",), 1)]


@pytest.mark.parametrize("argv,message", [
    (["--lora-modules", "x=/x"], r"with several models, say which one.*base_model_name"),
    (["--lora-modules", '{"name": "x", "path": "/x", "base_model_name": "c"}'],
     "base_model_name `c` is not served"),
    (["--lora-modules", '{"name": "b", "path": "/x", "base_model_name": "a"}'],
     "the adapter `b` of the model `a` has the name of the model `b`"),
    (["--lora-modules", '{"name": "x", "path": "/x", "base_model_name": "a"}',
      '{"name": "x", "path": "/y", "base_model_name": "b"}'],
     "the adapter `x` of the model `b` has the name of an adapter of the model `a`"),
    (["--lora-modules", '{"name": "x"'], "is not JSON"),
])
def test_lora_module_errors_name_both(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _checked("--model", "/a", "--model", "/b", "--enable-lora", *argv)
