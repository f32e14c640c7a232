"""Resumable WebSocket generations: their frames recorded in a stream, followed by any socket of
the same key (`resume{id, stream_id, after_seq}`, docs/websocket.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.errors import ApiError
from gateway.resumable import ResumableStream, owner_digest

KIND = "ws"
RECORDED = frozenset({"generation.delta", "generation.done", "error"})  # a generation's own


def socket_owner(authorization: str, subprotocols: list[str]) -> bytes:
    """The key a socket presented: its Bearer header, else its `bearer.<key>` subprotocol."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return owner_digest(token.strip())
    tokens = [p[len("bearer."):] for p in subprotocols if p.startswith("bearer.")]
    return owner_digest(tokens[0] if tokens else None)


def record(stream: ResumableStream, frame: dict[str, Any]) -> bool:
    """Append one of a generation's frames (deltas numbered by the stream's seq); True when
    it was its last."""
    if frame["type"] == "generation.delta":
        frame["seq"] = stream.next_seq
    raw = msgspec.json.encode(frame)
    stream.append(raw, len(raw))
    return frame["type"] != "generation.delta"


async def follow(stream: ResumableStream, after: int, gen_id: str
                 ) -> AsyncIterator[dict[str, Any]]:
    """The generation's frames after seq `after` (fresh dicts, named `gen_id` on this socket),
    then the live ones until its last; an error frame if this reader fell behind the buffer."""
    try:
        async for item in stream.follow(after):
            if item is not None:
                frame = msgspec.json.decode(item[1])
                frame["id"] = gen_id
                yield frame
    except ApiError as exc:
        yield {"type": "error", "id": gen_id, "error": msgspec.to_builtins(exc.body)}
