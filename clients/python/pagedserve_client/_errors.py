"""Typed errors: one class per HTTP status family, each carrying the server's code, param, type."""

from __future__ import annotations

from typing import Any

import msgspec


class PagedServeError(Exception):
    """Base of every error the SDK raises."""


class APIError(PagedServeError):
    """An error the server reported (HTTP status, or an error event inside a stream)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, request_id: str | None = None,
                 status_code: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.request_id = request_id
        self.status_code = status_code
        self.body = body

    def __str__(self) -> str:
        status = f"{self.status_code} " if self.status_code is not None else ""
        return f"{status}{self.code or 'error'}: {self.message}"


class APIStatusError(APIError):
    """The server answered with a 4xx/5xx status."""


class BadRequestError(APIStatusError): ...          # 400
class AuthenticationError(APIStatusError): ...      # 401
class PermissionDeniedError(APIStatusError): ...    # 403
class NotFoundError(APIStatusError): ...            # 404
class ConflictError(APIStatusError): ...            # 409
class RequestTooLargeError(APIStatusError): ...     # 413
class UnprocessableEntityError(APIStatusError): ... # 422
class RateLimitError(APIStatusError): ...           # 429
class InternalServerError(APIStatusError): ...      # >= 500
class ServiceUnavailableError(InternalServerError): ...  # 503 (overload, draining, engine down)


class StreamError(APIError):
    """An `{"error": ...}` event arrived inside a stream (SSE or WebSocket)."""


class APIConnectionError(PagedServeError):
    """The server could not be reached, or the connection broke."""

    def __init__(self, message: str = "connection error", *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class APITimeoutError(APIConnectionError):
    """The request timed out."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError,
    404: NotFoundError, 409: ConflictError, 413: RequestTooLargeError,
    422: UnprocessableEntityError, 429: RateLimitError, 503: ServiceUnavailableError,
}


def _error_fields(body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return {}
    return {k: error.get(k) if isinstance(error.get(k), str) else None
            for k in ("message", "code", "param", "type")}


def status_error(status: int, content: bytes, request_id: str | None) -> APIStatusError:
    """The typed error for a response with this status and body (any body, JSON or not)."""
    try:
        body: Any = msgspec.json.decode(content)
    except msgspec.DecodeError:
        body = content.decode("utf-8", "replace")
    fields = _error_fields(body)
    message = fields.pop("message", None) or (body if isinstance(body, str) and body
                                              else f"HTTP {status}")
    cls = _BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    return cls(message, status_code=status, request_id=request_id, body=body, **fields)


def stream_error(payload: Any, request_id: str | None = None) -> StreamError:
    """The error for an in-stream `{"error": {...}}` event."""
    fields = _error_fields(payload)
    message = fields.pop("message", None) or "the server reported an error mid-stream"
    return StreamError(message, request_id=request_id, body=payload, **fields)
