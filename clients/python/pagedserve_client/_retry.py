"""Retry policy shared by both clients: which answers to retry and how long to wait."""

from __future__ import annotations

import email.utils
import random
import time

import httpx

RETRY_STATUSES = frozenset({408, 409, 429})
INITIAL_DELAY = 0.5
MAX_DELAY = 8.0
MAX_RETRY_AFTER = 60.0


def should_retry(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


def retry_delay(attempt: int, headers: httpx.Headers | None = None) -> float:
    """Seconds before retry number `attempt` (0-based): the server's Retry-After when it gives
    a sensible one, else exponential backoff with jitter."""
    given = _retry_after(headers) if headers is not None else None
    if given is not None:
        return given
    base = min(INITIAL_DELAY * 2**attempt, MAX_DELAY)
    return base * (1 - 0.25 * random.random())


def _retry_after(headers: httpx.Headers) -> float | None:
    # NOTE: like the official SDKs, a zero or absurd value is ignored in favour of backoff.
    value: float | None = None
    if (ms := headers.get("retry-after-ms")) is not None:
        value = _number(ms, 1e-3)
    elif (raw := headers.get("retry-after")) is not None:
        value = _number(raw, 1.0)
        if value is None:
            value = _seconds_until(raw)
    if value is None or not 0 < value <= MAX_RETRY_AFTER:
        return None
    return value


def _number(text: str, scale: float) -> float | None:
    try:
        return float(text) * scale
    except ValueError:
        return None


def _seconds_until(http_date: str) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()
