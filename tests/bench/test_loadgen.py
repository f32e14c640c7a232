"""bench/loadgen.py's client against a scripted SSE server (aiohttp's own web server on a free
127.0.0.1 port): what each kind of reply is recorded as."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from bench.loadgen import (
    Target,
    client_session,
    first_model,
    run_client,
    run_concurrency,
    send_one,
)
from bench.serve import free_port
from bench.workloads import RequestSpec


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    prompt = (await request.json())["prompt"]
    if prompt == "500":
        return web.Response(status=500, text="boom")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(_event({"choices": [{"index": 0, "text": f"t{i}"}]}))
    if prompt == "error":
        await resp.write(_event({"error": {"message": "engine died"}}))
    elif prompt == "bad json":
        await resp.write(b"data: {not json\n\n")
    elif prompt != "no done":
        await resp.write(_event({"choices": [], "usage": {"prompt_tokens": 5,
                                                           "completion_tokens": 3}}))
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "scripted"}]})


async def _with_server(body) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # NOTE: port 0: the kernel picked it
    try:
        await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_each_reply_kind_is_recorded() -> None:
    async def body(url: str) -> None:
        async with client_session() as session:
            assert await first_model(session, url) == "scripted"
            target = Target(url, "scripted", "completions", timeout=10)
            spec = RequestSpec(4, 3)
            ok = await send_one(session, target, "fine", spec)
            assert ok.ok and ok.error is None
            assert (ok.prompt_tokens, ok.output_tokens, len(ok.chunk_times)) == (5, 3, 3)
            assert ok.ttft == ok.chunk_times[0] and ok.e2e >= ok.chunk_times[-1]
            kinds = {p: (await send_one(session, target, p, spec)).error
                     for p in ("500", "error", "bad json", "no done")}
            assert kinds == {"500": "http_500", "error": "stream_error",
                             "bad json": "bad_json", "no done": "no_done"}
            # NOTE: without usage, one token per content chunk
            assert (await send_one(session, target, "no done", spec)).output_tokens == 3
            recs, _ = await run_concurrency(session, target, [("fine", spec)] * 6, 3, 30, 30,
                                            lambda: None)
            assert len(recs) == 6 and all(r.ok for r in recs)

    asyncio.run(_with_server(body))


def test_a_refused_connection_and_a_silent_server_are_recorded_not_raised() -> None:
    free = free_port()  # NOTE: a port just freed: nothing listens there

    async def body() -> None:
        async with client_session() as session:
            rec = await send_one(session, Target(f"http://127.0.0.1:{free}", "m", "completions"),
                                 "x", RequestSpec(1, 1))
            assert not rec.ok and rec.error == "connect"
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        async with silent, client_session() as session:
            target = Target(f"http://127.0.0.1:{port}", "m", "completions", timeout=0.5)
            rec = await send_one(session, target, "x", RequestSpec(1, 1))
            assert not rec.ok and rec.error == "timeout"

    run_client(body())


_SSE = (b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
        b"data: [DONE]\n\n")


async def _one_reply_per_connection(reader: asyncio.StreamReader,
                                    writer: asyncio.StreamWriter) -> None:
    """Answers the first request on a connection as keep-alive, then closes the connection
    when the next request's head arrives, unanswered (what llama-server does after a stream)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
                 + str(len(_SSE)).encode() + b"\r\n\r\n" + _SSE)
    await writer.drain()
    await reader.read(1)
    writer.close()


def test_a_pooled_connection_the_server_closed_is_sent_again_once() -> None:
    async def body() -> None:
        server = await asyncio.start_server(_one_reply_per_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, client_session() as session:
            target = Target(f"http://127.0.0.1:{port}", "m", "completions", timeout=10)
            recs = [await send_one(session, target, "x", RequestSpec(1, 1)) for _ in range(4)]
            assert [r.error for r in recs] == [None] * 4
            assert all(r.output_tokens == 1 for r in recs)

    run_client(body())
