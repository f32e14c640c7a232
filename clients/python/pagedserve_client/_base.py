"""What the sync and async clients share: settings, URLs, headers, request bodies."""

from __future__ import annotations

import os
from typing import Any

import httpx
import msgspec

from pagedserve_client._errors import APIConnectionError, APITimeoutError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_MAX_RETRIES = 2


class ClientSettings:
    """Base URL (the server root; a trailing `/v1` is accepted), key, timeout, retries."""

    def __init__(self, base_url: str | None, api_key: str | None,
                 timeout: float | httpx.Timeout | None, max_retries: int) -> None:
        url = (base_url or os.environ.get("PAGEDSERVE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.base_url = url.removesuffix("/v1")
        self.api_key = api_key if api_key is not None else os.environ.get("PAGEDSERVE_API_KEY")
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.max_retries = max_retries

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "pagedserve-client-python/0.1"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @property
    def ws_url(self) -> str:
        scheme, rest = self.base_url.split("://", 1)
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/v1/ws"


def body(params: dict[str, Any]) -> bytes:
    """A request body: parameters left as None are not sent."""
    return msgspec.json.encode({k: v for k, v in params.items() if v is not None})


def connection_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"request timed out: {exc}")
    return APIConnectionError(f"connection error: {exc}")
