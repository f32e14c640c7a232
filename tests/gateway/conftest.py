"""Gateway test fixtures: the bundled tokenizer as HF files, and a scripted EngineClient double."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gateway_fakes import FakeEngine


@pytest.fixture(scope="session")
def tokenizer_dir(bundled_tokenizer_dir: Path) -> Path:
    """The bundled model's tokenizer directory ($PAGEDSERVE_TEST_TOKENIZER reuses one): HF's
    own export of the GGUF's tokenizer (tests/conftest.py), made once per machine."""
    given = os.environ.get("PAGEDSERVE_TEST_TOKENIZER")
    if given and (Path(given) / "tokenizer.json").is_file():
        return Path(given)
    return bundled_tokenizer_dir


@pytest.fixture
def fake_engine(tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(tokenizer_dir)
