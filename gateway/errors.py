"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import msgspec
from starlette.responses import Response


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """Raised anywhere in a handler; becomes a JSON error response (or an SSE/WS error event)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def body(self) -> ErrorBody:
        kind = _TYPES.get(self.status,
                          "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorBody(self.message, kind, self.param, self.code)

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(self.body)

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.envelope()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def unavailable(message: str, code: str, retry_after: int = 1) -> ApiError:
    """503 with a positive Retry-After: both official SDKs retry on it, honouring the header."""
    return ApiError(503, message, code, headers={"Retry-After": str(max(1, retry_after))})
