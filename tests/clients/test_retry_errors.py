"""The Python SDK's retry policy and typed errors, against scripted transports (no server)."""

from __future__ import annotations

import httpx
import pagedserve_client as ps
import pytest
from pagedserve_client._retry import retry_delay

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
OK_BODY = {"id": "r1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"},
                                    "finish_reason": "stop", "brand_new_field": 1}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
           "future": {"x": 1}}


def _error(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"message": f"boom {status}", "type": "t", "param": "p", "code": code}}
    return httpx.Response(status, json=body, headers={"x-request-id": "req-9", **(headers or {})})


def _client(responses: list[httpx.Response | Exception], seen: list[httpx.Request]) -> ps.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        item = responses.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return ps.Client("http://test/v1", api_key="k", http_client=http, max_retries=2)


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503])
def test_retries_then_succeeds(status: int) -> None:
    seen: list[httpx.Request] = []
    client = _client([_error(status, "x", {"retry-after": "0.01"}),
                      httpx.Response(200, json=OK_BODY)], seen)
    reply = client.chat.completions.create(**CHAT)
    assert len(seen) == 2 and reply.choices[0].message.content == "yo"
    assert reply.choices[0].finish_reason == ps.FinishReason.STOP
    assert seen[0].headers["authorization"] == "Bearer k"
    assert str(seen[0].url) == "http://test/v1/chat/completions"


@pytest.mark.parametrize("status, cls", [
    (400, ps.BadRequestError), (401, ps.AuthenticationError), (403, ps.PermissionDeniedError),
    (404, ps.NotFoundError), (413, ps.RequestTooLargeError), (422, ps.UnprocessableEntityError),
])
def test_client_errors_are_typed_and_not_retried(status: int, cls: type) -> None:
    seen: list[httpx.Request] = []
    client = _client([_error(status, "bad_thing")], seen)
    with pytest.raises(cls) as info:
        client.chat.completions.create(**CHAT)
    err = info.value
    assert len(seen) == 1
    assert (err.status_code, err.code, err.param, err.type, err.request_id) == (
        status, "bad_thing", "p", "t", "req-9")
    assert err.message == f"boom {status}" and isinstance(err, ps.APIStatusError)


def test_gives_up_after_max_retries() -> None:
    seen: list[httpx.Request] = []
    client = _client([_error(503, "overloaded", {"retry-after-ms": "5"})] * 3, seen)
    with pytest.raises(ps.ServiceUnavailableError) as info:
        client.models.list()
    assert len(seen) == 3 and isinstance(info.value, ps.InternalServerError)
    assert info.value.code == "overloaded"


def test_connection_errors_retry_then_raise() -> None:
    seen: list[httpx.Request] = []
    client = _client([httpx.ConnectError("refused")] * 3, seen)
    client.settings.max_retries = 2
    with pytest.raises(ps.APIConnectionError):
        client.models.list()
    assert len(seen) == 3


def test_non_json_error_body() -> None:
    seen: list[httpx.Request] = []
    client = _client([httpx.Response(502, text="bad gateway")] * 3, seen)
    with pytest.raises(ps.InternalServerError) as info:
        client.models.list()
    assert info.value.message == "bad gateway" and info.value.status_code == 502


def test_stream_error_event_raises_and_is_not_retried() -> None:
    sse = (b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
           b'data: {"error": {"message": "engine died", "type": "server_error", '
           b'"param": null, "code": "engine_error"}}\n\ndata: [DONE]\n\n')
    seen: list[httpx.Request] = []
    client = _client([httpx.Response(200, content=sse, headers={"x-request-id": "c1"})], seen)
    stream = client.chat.completions.create(**CHAT, stream=True)
    assert next(stream).text == "a"
    with pytest.raises(ps.StreamError) as info:
        next(stream)
    assert info.value.code == "engine_error" and info.value.request_id == "c1"
    assert len(seen) == 1


def test_done_ends_the_stream() -> None:
    sse = (b': keep-alive\n\ndata: {"id": "c", "choices": [{"index": 0, "text": "x"}]}\n\n'
           b"data: [DONE]\n\ndata: {not json after done}\n\n")
    client = _client([httpx.Response(200, content=sse)], [])
    with client.completions.create(prompt="p", stream=True) as stream:
        assert [c.text for c in stream] == ["x"]


def test_retry_delay_honours_retry_after() -> None:
    assert retry_delay(0, httpx.Headers({"retry-after": "3"})) == 3
    assert retry_delay(0, httpx.Headers({"retry-after-ms": "250"})) == 0.25
    assert 0.3 <= retry_delay(0, httpx.Headers({"retry-after": "0"})) <= 0.5  # NOTE: 0 ignored
    assert 0.3 <= retry_delay(0, httpx.Headers({"retry-after": "junk"})) <= 0.5
    assert 1.4 <= retry_delay(2) <= 2.0
    assert retry_delay(10) <= 8.0


async def test_async_client_retries() -> None:
    seen: list[httpx.Request] = []
    responses = [_error(429, "slow_down", {"retry-after": "0.01"}),
                 httpx.Response(200, json={"data": [{"id": "m", "extra": True}]})]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return responses.pop(0)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with ps.AsyncClient("http://test", http_client=http) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["m"] and len(seen) == 2
