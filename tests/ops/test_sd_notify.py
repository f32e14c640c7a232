"""ipc.sd_notify against a fake $NOTIFY_SOCKET, alone and inside the engine loop."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
from ops_support import NotifySocket

from ipc.sd_notify import Notifier


def test_messages_reach_the_socket(notify_socket: NotifySocket) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    assert n.enabled and n.watchdog_interval is None
    assert n.status("loading\nthe model")
    assert n.ready("serving x")
    assert n.watchdog()
    assert n.stopping()
    n.close()
    notify_socket.wait_for("STOPPING", timeout=5)
    assert notify_socket.poll() == [
        {"STATUS": "loading the model"},  # NOTE: a newline must not start a new assignment
        {"READY": "1", "STATUS": "serving x"},
        {"WATCHDOG": "1"},
        {"STOPPING": "1"},
    ]


def test_abstract_namespace_socket() -> None:
    name = f"pagedserve-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert server.recv(100) == b"READY=1"


def test_disabled_without_notify_socket() -> None:
    n = Notifier({})
    assert not n.enabled
    assert not n.ready() and not n.watchdog()


def test_a_missing_socket_is_not_fatal(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not n.ready()
    assert not n.watchdog()
    assert len([r for r in caplog.records if "sd_notify" in r.message]) == 1


@pytest.mark.parametrize("env, interval", [
    ({"WATCHDOG_USEC": "4000000"}, 2.0),
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_watchdog_interval(env: dict[str, str], interval: float | None) -> None:
    assert Notifier({"NOTIFY_SOCKET": "/x", **env}).watchdog_interval == interval
