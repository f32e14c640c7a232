"""The resumable-stream registry on its own: replay then live tail, the grace timer, key
binding, tombstones, and the byte and age bounds (gateway/resumable.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import ApiError
from gateway.resumable import StreamRegistry, owner_digest, parse_last_event_id
from gateway.settings import StreamLimits

ALICE, BOB = owner_digest("alice"), owner_digest("bob")
DONE = b"[DONE]"


class Producer:
    """Appends the events it is handed; `cancel` ends it the way an engine abort does (a
    last event, then the end)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.cancels = 0

    async def __call__(self, stream) -> None:  # type: ignore[no-untyped-def]
        while True:
            event = await self.queue.get()
            stream.append(event, len(event))
            if event == DONE:
                return

    def cancel(self) -> None:
        self.cancels += 1
        self.queue.put_nowait(b"abort")
        self.queue.put_nowait(DONE)


async def _read(stream, after: int) -> list[tuple[int, bytes]]:  # type: ignore[no-untyped-def]
    return [item async for item in stream.follow(after) if item is not None]


async def _until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_replay_then_live_tail_for_two_readers() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=30))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    for event in (b"a", b"b", b"c"):
        producer.queue.put_nowait(event)
    await _until(lambda: stream.next_seq == 3)
    first = asyncio.create_task(_read(stream, -1))
    second = asyncio.create_task(_read(stream, 1))
    await _until(lambda: stream.readers == 2)
    producer.queue.put_nowait(b"d")
    producer.queue.put_nowait(DONE)
    assert await first == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d"), (4, DONE)]
    assert await second == [(2, b"c"), (3, b"d"), (4, DONE)]
    # a resume racing with the finish: the tail, then the end, once
    assert await _read(stream, 3) == [(4, DONE)]
    assert await _read(stream, 4) == []
    assert producer.cancels == 0


async def test_grace_period_aborts_then_resume_is_expired() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=0.05))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    producer.queue.put_nowait(b"a")
    reader = stream.follow(-1)
    assert await anext(reader) == (0, b"a")
    await asyncio.sleep(0.2)  # NOTE: four grace periods with a reader attached: no expiry
    assert producer.cancels == 0 and registry.find(stream.id, "sse", ALICE) is stream
    await reader.aclose()  # the connection drops
    await _until(lambda: producer.cancels == 1)
    assert (registry.expired, registry.aborted, registry.buffered_bytes) == (1, 1, 0)
    with pytest.raises(ApiError) as expired:
        registry.find(stream.id, "sse", ALICE)
    assert (expired.value.status, expired.value.code) == (410, "stream_expired")
    for owner, kind in ((BOB, "sse"), (ALICE, "ws")):
        with pytest.raises(ApiError) as other:
            registry.find(stream.id, kind, owner)
        assert (other.value.status, other.value.code) == (404, "stream_not_found")
    await _until(lambda: stream.done)
    assert stream.next_seq == 1  # the aborted generation's last events were not kept
    assert producer.cancels == 1


async def test_a_finished_stream_is_forgotten_after_the_grace_period() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=0.05))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    producer.queue.put_nowait(DONE)
    assert await _read(stream, -1) == [(0, DONE)]
    await _until(lambda: registry.num_streams == 0)
    assert (registry.expired, registry.aborted, producer.cancels) == (1, 0, 0)


async def test_per_stream_and_global_bounds() -> None:
    limits = StreamLimits(grace_period=30, max_stream_bytes=12, max_total_bytes=25)
    registry = StreamRegistry(limits)
    producers = [Producer() for _ in range(3)]
    streams = [registry.open("sse", ALICE, p, p.cancel) for p in producers]
    peak = 0
    for i in range(8):
        for producer, stream in zip(producers, streams, strict=True):
            producer.queue.put_nowait(b"xxxx")
            await _until(lambda s=stream, n=i + 1: s.next_seq == n)
            peak = max(peak, registry.buffered_bytes)
            assert stream.bytes <= 12
    assert peak <= 25 and registry.buffered_bytes == sum(s.bytes for s in streams)
    assert registry.events_dropped == 24 - registry.buffered_bytes // 4
    with pytest.raises(ApiError) as gone:
        streams[0].check_after(0)
    assert gone.value.code == "stream_expired"
    streams[0].check_after(streams[0].first_seq - 1)  # what is kept can still be resumed
    with pytest.raises(ApiError) as never:
        streams[0].check_after(8)
    assert (never.value.status, never.value.param) == (400, "after")


async def test_a_reader_that_falls_behind_the_buffer_is_told() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=30, max_stream_bytes=4))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    producer.queue.put_nowait(b"ab")
    reader = stream.follow(-1)
    assert await anext(reader) == (0, b"ab")
    for event in (b"cd", b"ef", b"gh"):
        producer.queue.put_nowait(event)
    await _until(lambda: stream.next_seq == 4)
    with pytest.raises(ApiError) as behind:
        await anext(reader)
    assert behind.value.code == "stream_expired"


async def test_a_resume_from_just_before_the_buffer_is_expired() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=30, max_stream_bytes=4))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    for event in (b"ab", b"cd", b"ef"):
        producer.queue.put_nowait(event)
    await _until(lambda: stream.next_seq == 3)
    assert stream.first_seq == 1  # seq 0 was dropped to keep 4 bytes
    stream.check_after(0)  # the next event, seq 1, is kept: this resume is whole
    # resuming after seq -1 needs seq 0, which is gone: 410, not a stream with a hole
    with pytest.raises(ApiError) as gone:
        stream.check_after(-1)
    assert (gone.value.status, gone.value.code) == (410, "stream_expired")
    reader = stream.follow(0)
    assert [await anext(reader), await anext(reader)] == [(1, b"cd"), (2, b"ef")]
    await reader.aclose()


async def test_old_events_age_out() -> None:
    registry = StreamRegistry(StreamLimits(grace_period=30, max_event_age=0.05))
    producer = Producer()
    stream = registry.open("sse", ALICE, producer, producer.cancel)
    producer.queue.put_nowait(b"old")
    await _until(lambda: stream.next_seq == 1)
    await asyncio.sleep(0.1)
    producer.queue.put_nowait(b"new")
    await _until(lambda: stream.next_seq == 2)
    assert stream.first_seq == 1 and registry.buffered_bytes == 3


def test_last_event_id_and_limits_are_checked() -> None:
    assert parse_last_event_id("abc:12", "abc") == 12
    for bad in ("abd:12", "abc", "abc:x", "abc:"):
        with pytest.raises(ApiError):
            parse_last_event_id(bad, "abc")
    with pytest.raises(ValueError, match="grace_period"):
        StreamLimits(grace_period=0)
