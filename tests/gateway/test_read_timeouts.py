"""gateway/read_timeouts.py's head count, read by read (no server): what is counted as head."""

from __future__ import annotations

from gateway.read_timeouts import MAX_HEAD_BYTES, TimedHttpToolsProtocol


def _count(*reads: bytes) -> tuple[int, bool]:
    proto = TimedHttpToolsProtocol.__new__(TimedHttpToolsProtocol)  # NOTE: no connection
    over = [proto._head_too_large(r) for r in reads]
    return proto._head_bytes, over[-1]


def test_the_head_ends_at_its_blank_line_even_across_reads() -> None:
    head = b"POST /x HTTP/1.1\r\nHost: h\r\n\r\n"
    body = b"b" * 40_000
    assert _count(head + body) == (len(head), False)  # NOTE: the body in the read: not head
    assert _count(head[:-3], head[-3:] + body) == (len(head), False)  # \r | \n\r\n
    assert _count(head[:-2], head[-2:] + body) == (len(head), False)  # \r\n | \r\n
    assert _count(head[:-1], head[-1:] + body) == (len(head), False)


def test_leading_blank_lines_do_not_end_the_head() -> None:
    big = b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"
    assert _count(b"\r\n\r\n" + big)[1]
    assert _count(b"\r\n", b"\r\n", big)[1]
    assert _count(b"\r\n\r\n", b"GET / HTTP/1.1\r\n", b"X: " + b"a" * MAX_HEAD_BYTES)[1]
    assert not _count(b"\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n")[1]


def test_an_endless_header_line_is_counted_read_by_read() -> None:
    chunks = [b"GET / HTTP/1.1\r\nX: "] + [b"a" * 4096] * 3
    assert not _count(*chunks)[1]
    assert _count(*chunks, b"a" * 4096)[1]
