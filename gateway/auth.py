"""API-key auth on /v1 and /models: `Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>`,
compared in constant time (WebSockets check it in the session)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.anthropic_errors import anthropic_error_response, is_messages_path
from gateway.errors import ApiError

# NOTE: /models/ is the run-time model management (gateway/api/model_management.py)
_GUARDED = ("/v1/", "/models")


class ApiKeyMiddleware:
    """Key auth on /v1; a failure is a 401 in the route's error shape (OpenAI's, or
    Anthropic's on /v1/messages)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._key is None
            or scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not scope["path"].startswith(_GUARDED)
            or bearer_ok(_header(scope, b"authorization"), self._key)
            or key_ok(_header(scope, b"x-api-key"), self._key)
        ):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "missing or invalid API key", "invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        if is_messages_path(scope["path"]):
            response = anthropic_error_response(error)
        else:
            response = error.response()
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope.get("headers", []):
        if key == name:
            return value
    return b""


def bearer_ok(header: bytes, key: bytes) -> bool:
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def key_ok(header: bytes, key: bytes) -> bool:
    """Anthropic's `x-api-key` (accepted on every /v1 route, as the Bearer token is)."""
    return bool(header) and hmac.compare_digest(header.strip(), key)
