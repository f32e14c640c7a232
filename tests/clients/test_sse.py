"""The Python SDK's SSE parser, fed byte streams split at every offset."""

from __future__ import annotations

from pagedserve_client import ServerSentEvent, SSEDecoder

STREAM = (
    ": ping\n\n"
    'data: {"text": "h\u00e9llo \u4e16\u754c \U0001f600"}\n\n'
    "event: error\r\ndata: line one\r\ndata: line two\r\n\r\n"
    "id: 7\rretry: 50\rdata:no-space\r\r"
    "data: [DONE]\n\n"
    "data: unfinished"
).encode()

EXPECTED = [
    ServerSentEvent('{"text": "h\u00e9llo \u4e16\u754c \U0001f600"}'),
    ServerSentEvent("line one\nline two", event="error"),
    ServerSentEvent("no-space", id="7", retry=50),
    ServerSentEvent("[DONE]", id="7"),
]


def _parse(parts: list[bytes]) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    return [event for part in parts for event in decoder.feed(part)]


def test_whole_stream() -> None:
    assert _parse([STREAM]) == EXPECTED


def test_split_at_every_offset() -> None:
    for i in range(len(STREAM) + 1):
        assert _parse([STREAM[:i], STREAM[i:]]) == EXPECTED, i


def test_split_at_every_two_offsets() -> None:
    for i in range(0, len(STREAM), 3):
        for j in range(i, len(STREAM), 5):
            assert _parse([STREAM[:i], STREAM[i:j], STREAM[j:]]) == EXPECTED, (i, j)


def test_one_byte_at_a_time() -> None:
    assert _parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_comments_and_empty_events_are_ignored() -> None:
    assert _parse([b": a comment\n\n\n:another\n\n"]) == []
