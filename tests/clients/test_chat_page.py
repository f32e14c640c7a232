"""The gateway serves the chat page at `/` and its static files (the SDK's browser build)."""

from __future__ import annotations

import httpx


def test_chat_page_and_static_files(server_url: str) -> None:
    page = httpx.get(f"{server_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/chat.js">' in page.text
    for path in ("chat.js", "chat.css", "sdk/index.js", "sdk/ws.js"):
        response = httpx.get(f"{server_url}/static/{path}")
        assert response.status_code == 200, path
    assert "javascript" in httpx.get(f"{server_url}/static/chat.js").headers["content-type"]
    assert httpx.get(f"{server_url}/static/nope.js").status_code == 404
