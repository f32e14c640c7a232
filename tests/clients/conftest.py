"""Client test fixtures: one real server on the tiny random Llama for the whole session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_server import running_server  # noqa: E402


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    with running_server() as url:
        yield url
