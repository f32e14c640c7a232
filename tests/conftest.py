"""Shared fixtures: the bundled model's files, and tiny random-weight Llama models."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_llama import build_tiny_llama


@pytest.fixture(scope="session")
def bundled_tokenizer_dir() -> Path:
    """Tokenizer files of the bundled model (exported from its GGUF once, then cached)."""
    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    return tokenizer_dir(resolve_model(None))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_tokenizer_dir) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads) and the bundled tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_tokenizer_dir)


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory, bundled_tokenizer_dir) -> Path:
    """The tiny Llama with widths that are multiples of 256, for the K-quants' super-blocks."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-wide"), bundled_tokenizer_dir,
                            hidden_size=256, intermediate_size=512)
