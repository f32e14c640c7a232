"""Stored Responses (`store: true`): a bounded in-memory map from response id to the response's
JSON and the conversation behind it, evicted oldest first past a byte budget or an age."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gateway.requests import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its JSON (what GET returns) and the conversation it ended, as chat
    messages (its input, without `instructions`, then its output), which
    `previous_response_id` continues."""

    response_json: bytes
    conversation: tuple[ChatMessage, ...]
    stored_at: float
    size: int  # bytes counted against the store's budget


class ResponseStore:
    """At most `max_bytes` of responses (their JSON plus their conversation's), none older than
    `max_age` seconds. A response larger than the whole budget is not kept."""

    def __init__(self, max_bytes: int, max_age: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0 or not max_age > 0:
            raise ValueError("the response store needs max_bytes >= 0 and max_age > 0")
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, response_json: bytes,
            conversation: list[ChatMessage]) -> bool:
        """Keep a response (replacing one of the same id); False if it is too large to keep."""
        self.delete(response_id)
        size = len(response_json) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return False
        self._entries[response_id] = StoredResponse(response_json, tuple(conversation),
                                                    self._clock(), size)
        self.bytes += size
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self) -> None:
        oldest = self._clock() - self.max_age
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at >= oldest and self.bytes <= self.max_bytes:
                return
            self.delete(next(iter(self._entries)))
