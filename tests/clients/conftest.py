"""Client test fixtures: a real server on the tiny random Llama, one per test module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_server import running_server  # noqa: E402


# NOTE: module scope, so no server outlives this folder's tests in a full run.
@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with running_server() as url:
        yield url
