"""systemd's notify protocol (sd_notify(3)) in stdlib: READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

Every call is a no-op when $NOTIFY_SOCKET is unset, so the same code runs under systemd and not.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Datagrams to $NOTIFY_SOCKET (a path, or `@name` in the abstract namespace)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        self._failed = False
        self.watchdog_interval = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return bool(self._addr)

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=value` lines in one datagram; False when disabled or the send failed."""
        if not self._addr:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # NOTE: never block: this runs on the event loop (and the engine's busy loop), and
            # a receiver that stopped reading must not stall them.
            self._sock.sendto("\n".join(assignments).encode(), socket.MSG_DONTWAIT, self._addr)
        except OSError as exc:
            # NOTE: a lost notification must never take the server down; say it once.
            if not self._failed:
                log.warning("sd_notify to %r failed: %s", self._addr, exc)
            self._failed = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> list[str]:
    # NOTE: one STATUS line: a newline would start another assignment.
    return [] if text is None else ["STATUS=" + " ".join(text.split())]


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of $WATCHDOG_USEC in seconds (systemd's advice), or None if no watchdog is asked
    of this process ($WATCHDOG_PID names another one, or the values are not numbers)."""
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
