"""A request's body read under the server's size and time limits (every HTTP route)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from gateway.errors import ApiError


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (header or stream), and
    with 408 (the connection then closes) when it takes longer than `timeout` seconds."""
    too_large = ApiError(413, f"request body is larger than {limit} bytes", "request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        # NOTE: Connection: close, as the rest of the body is not awaited
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       "request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)
