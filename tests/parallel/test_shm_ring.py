"""ShmRing: one writer, several readers; wrap-around, a slow reader, a writer ahead of readers."""

from __future__ import annotations

import threading
import time

import pytest

from engine.parallel.shm_ring import RingClosedError, ShmRing

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ring():
    r = ShmRing(2, 256, create=True)
    yield r
    r.close()


def test_records_wrap_around_the_end_intact(ring: ShmRing) -> None:
    reader = ShmRing(2, name=ring.name)
    try:
        for i in range(200):  # ~20 laps of a 256-byte ring, sizes that never align
            payload = bytes([i % 256]) * (i % 37 + 1)
            ring.write(payload)
            assert reader.read(0) == payload
            assert reader.read(1) == payload
    finally:
        reader.close()


def test_a_slow_reader_holds_the_writer_back(ring: ShmRing) -> None:
    ring.write(b"a" * 100)
    assert ring.read(0) == b"a" * 100  # reader 1 has not read it yet
    ring.write(b"b" * 100)
    with pytest.raises(RingClosedError):
        ring.write(b"c" * 100, timeout=0.2)  # would overwrite reader 1's unread record
    assert ring.read(1) == b"a" * 100
    ring.write(b"c" * 100, timeout=1.0)  # now there is room
    assert [ring.read(1), ring.read(1)] == [b"b" * 100, b"c" * 100]
    assert [ring.read(0), ring.read(0)] == [b"b" * 100, b"c" * 100]


def test_writer_faster_than_readers_loses_nothing(ring: ShmRing) -> None:
    records = [i.to_bytes(4, "little") * (i % 9 + 1) for i in range(500)]
    got: list[list[bytes]] = [[], []]

    def read(reader: int, delay: float) -> None:
        for _ in records:
            got[reader].append(ring.read(reader, timeout=20.0))
            time.sleep(delay)

    threads = [threading.Thread(target=read, args=(r, d)) for r, d in ((0, 0.0), (1, 0.0005))]
    for t in threads:
        t.start()
    for rec in records:
        ring.write(rec, timeout=20.0)
    for t in threads:
        t.join(timeout=30.0)
    assert got == [records, records]


def test_a_dead_peer_raises_instead_of_hanging(ring: ShmRing) -> None:
    with pytest.raises(RingClosedError):
        ring.read(0, alive=lambda: False)
    with pytest.raises(ValueError, match="exceeds"):
        ring.write(b"x" * 300)
