"""Ops test fixtures: a fake systemd notify socket; tests/clients and tests/gateway go on the
path for the tiny-model server (tiny_server.py) and the scripted engine (gateway_fakes.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "clients"))
sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # gateway_fakes.py
from ops_support import NotifySocket  # noqa: E402


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()
