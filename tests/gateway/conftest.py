"""Gateway test fixtures: the bundled tokenizer as HF files, and a scripted EngineClient double."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_fakes import FakeEngine

_CONVERT = (
    "import sys; from transformers import AutoTokenizer; from ipc.model_source import bundled_gguf;"
    "p = bundled_gguf(); AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)"
    ".save_pretrained(sys.argv[1])"
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's tokenizer directory ($PAGEDSERVE_TEST_TOKENIZER reuses one)."""
    given = os.environ.get("PAGEDSERVE_TEST_TOKENIZER")
    if given and (Path(given) / "tokenizer.json").is_file():
        return Path(given)
    out = tmp_path_factory.mktemp("tokenizer")
    subprocess.run([sys.executable, "-c", _CONVERT, str(out)], check=True, timeout=300)
    return out


@pytest.fixture
def fake_engine(tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(tokenizer_dir)
