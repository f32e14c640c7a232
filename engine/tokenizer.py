"""Tokenizer files for a model: its own directory, or files derived once from a GGUF and cached.

The gateway reads the same directory with the `tokenizers` library (it never imports torch).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ipc.model_source import ModelSource

_MARKER = "tokenizer.json"


def tokenizer_dir(source: ModelSource, override: str | None = None) -> Path:
    """A directory holding tokenizer.json and tokenizer_config.json for this model."""
    if override is not None:
        return Path(override)
    if not source.is_gguf:
        return source.path
    cache = source.cache_dir() / "tokenizer"
    if not (cache / _MARKER).is_file():
        _export_gguf_tokenizer(source.path, cache)
    return cache


def _export_gguf_tokenizer(gguf_path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tok-"))
    try:
        tok.save_pretrained(tmp)
        # NOTE: rename is atomic: concurrent engines never see a half-written directory.
        os.replace(tmp, dest)
    except OSError:
        if not (dest / _MARKER).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(directory: Path):
    """The HF tokenizer for in-process use (LLM.generate)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
