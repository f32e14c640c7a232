"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with its
status codes: every failure on the /v1/messages routes (auth, body, validation, engine)."""

from __future__ import annotations

from typing import Literal

import msgspec
from starlette.responses import Response

from gateway.errors import ApiError

MESSAGES_PREFIX = "/v1/messages"

# status -> (status sent, Anthropic's error type). NOTE: Anthropic answers 529 when it is
# overloaded; the SDK retries it (and 503 would read as an api_error), so an engine that is
# not ready, a full queue or a drain become 529 with their Retry-After kept.
_STATUS = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    408: (408, "timeout_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
}


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    error: AnthropicErrorBody
    type: Literal["error"] = "error"


def anthropic_status(exc: ApiError) -> tuple[int, AnthropicError]:
    """The status and body Anthropic would send for `exc`; the message names the field."""
    status, kind = _STATUS.get(exc.status, (exc.status, "api_error"))
    if status >= 500 and exc.status != 503:
        status, kind = 500, "api_error"
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return status, AnthropicError(AnthropicErrorBody(kind, message))


def anthropic_error_response(exc: ApiError) -> Response:
    status, body = anthropic_status(exc)
    return Response(msgspec.json.encode(body), status_code=status, headers=exc.headers,
                    media_type="application/json")


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")
