"""Ops test fixtures: a fake systemd notify socket; tests/clients is put on the path for the
tiny-model server helpers (tiny_server.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "clients"))
from ops_support import NotifySocket  # noqa: E402


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()
