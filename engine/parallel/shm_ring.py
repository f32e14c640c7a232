"""A shared-memory byte ring: one writer, N readers, variable-length records, no pickling.

The driver writes each step's inputs once; every tensor-parallel worker reads every record.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory

# Header: write position, then one read position per reader; all monotonic byte counts (u64).
# A record is [u64 length][payload]; a length of _WRAP means "continue at offset 0".
_U64 = struct.Struct("<Q")
_WRAP = (1 << 64) - 1
_SPIN = 200  # busy polls before sleeping
_SLEEP_S = 50e-6


class RingClosedError(RuntimeError):
    """The other side is gone (or gave up waiting): the engine must go down."""


class ShmRing:
    """`create=True` makes the segment (the writer); readers attach by `name` and `reader`."""

    def __init__(self, num_readers: int, capacity: int = 1 << 24, *, name: str | None = None,
                 create: bool = False) -> None:
        self.num_readers = num_readers
        self._header = 8 * (1 + num_readers)
        if create:
            self._shm = shared_memory.SharedMemory(create=True, size=self._header + capacity)
            self._shm.buf[: self._header] = bytes(self._header)
        else:
            self._shm = _attach(name)
        self.capacity = self._shm.size - self._header
        self._owner = create
        self._buf = self._shm.buf

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        self._buf.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()

    # ---- positions ----------------------------------------------------------------------

    def _get(self, slot: int) -> int:
        return _U64.unpack_from(self._buf, 8 * slot)[0]

    def _set(self, slot: int, value: int) -> None:
        _U64.pack_into(self._buf, 8 * slot, value)

    # ---- writer -------------------------------------------------------------------------

    def write(self, payload: bytes | memoryview, alive: Callable[[], bool] = lambda: True,
              timeout: float | None = None) -> None:
        """Append one record; waits while the slowest reader has not freed enough space.

        `alive()` is polled while waiting: False (a reader died) raises RingClosedError.
        """
        size = len(payload)
        if size + 16 > self.capacity:
            raise ValueError(f"record of {size} bytes exceeds the ring's {self.capacity}")
        pos = self._get(0)
        offset = pos % self.capacity
        wrap = self.capacity - offset < size + 8  # NOTE: records never straddle the end
        need = (self.capacity - offset if wrap else 0) + size + 8
        _wait(lambda: pos + need - self._slowest() <= self.capacity, alive, timeout)
        if wrap:
            if self.capacity - offset >= 8:
                _U64.pack_into(self._buf, self._header + offset, _WRAP)
            pos += self.capacity - offset
            offset = 0
        start = self._header + offset
        _U64.pack_into(self._buf, start, size)
        self._buf[start + 8 : start + 8 + size] = payload
        # NOTE: the position is published after the payload is in place (x86 keeps stores in
        # order; a reader never sees a position ahead of its data).
        self._set(0, pos + 8 + size)

    def _slowest(self) -> int:
        return min(self._get(1 + r) for r in range(self.num_readers))

    # ---- readers ------------------------------------------------------------------------

    def read(self, reader: int, alive: Callable[[], bool] = lambda: True,
             timeout: float | None = None) -> bytes:
        """The next record for this reader (a copy); waits until the writer has written one."""
        slot = 1 + reader
        pos = self._get(slot)
        _wait(lambda: self._get(0) > pos, alive, timeout)
        offset = pos % self.capacity
        if self.capacity - offset < 8 or _U64.unpack_from(self._buf, self._header + offset)[0] \
                == _WRAP:
            pos += self.capacity - offset
            offset = 0
        start = self._header + offset
        size = _U64.unpack_from(self._buf, start)[0]
        data = bytes(self._buf[start + 8 : start + 8 + size])
        self._set(slot, pos + 8 + size)
        return data


def _wait(ready: Callable[[], bool], alive: Callable[[], bool], timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    spins = 0
    while not ready():
        spins += 1
        if spins < _SPIN:
            continue
        if not alive():
            raise RingClosedError("the other side of the ring is gone")
        if deadline is not None and time.monotonic() > deadline:
            raise RingClosedError(f"no progress on the ring for {timeout:g} s")
        time.sleep(_SLEEP_S if spins < 10 * _SPIN else 1e-3)


def _attach(name: str | None) -> shared_memory.SharedMemory:
    assert name is not None, "readers attach by name"
    # NOTE: the writer owns the segment. Before 3.13 a reader registers it with the resource
    # tracker too; our readers are spawned children sharing the writer's tracker, so that is
    # one registration, dropped when the writer unlinks.
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        return shared_memory.SharedMemory(name=name)
