"""Asyncio load generator for any OpenAI-compatible server: Poisson or closed-loop streams.

Each request is timed from its send: first content chunk (TTFT), every later chunk (ITL), last
byte (E2E). Failures are recorded by kind, never raised.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import uvloop

from bench.metrics import RequestRecord
from bench.workloads import RequestSpec

T = TypeVar("T")

# NOTE: common one-token English words: a prompt of n of them is about n BPE tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had not are "
    "but one all were when which their there an been more some would time said what about out "
    "up into only other new could also after first two over year way then many well people may "
    "back made over through work where day most after great world still good long life little "
    "own under never last right place home small found house old water city story light river "
    "night road tree stone king ship sea wind fire door book song name hand field cold green"
).split()


@dataclass(frozen=True)
class Target:
    base_url: str  # http://host:port
    model: str
    api: str = "chat"  # "chat" or "completions"
    ignore_eos: bool = True
    timeout: float = 300.0  # the connect, and each wait for the server's next bytes
    extra_body: tuple[tuple[str, object], ...] = ()  # more request fields (a peer's own)


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Runs the load generator's coroutine on uvloop.

    NOTE: the client shares the machine's cores with the server it measures, and its CPU
    grows with the tokens streamed: on 2 cores, 64 streams of 128 + 128 tokens against
    pagedserve (a8, float16 KV), the client took 0.76 s of CPU per 8192-token wave on
    asyncio's own loop and 0.62 s on uvloop (the gateway already runs on uvloop).
    """
    return uvloop.run(main)


def make_prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_words)))


def request_body(target: Target, prompt: str, spec: RequestSpec) -> dict:
    body: dict = {"model": target.model, "max_tokens": spec.output_len, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True  # NOTE: a vLLM-style extension; both servers here take it
    body.update(dict(target.extra_body))
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def client_session() -> aiohttp.ClientSession:
    """The session the load points share: no connection limit, long SSE lines allowed.

    NOTE: aiohttp, not httpx: its C HTTP parser reads a stream's lines at well under half of
    httpx's CPU (0.32-0.38 against 0.77-0.94 s per 8192-token wave of 64 streams), CPU that
    the server under test would otherwise lose on a small machine. vLLM's `bench serve`
    uses aiohttp too.
    """
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 read_bufsize=1 << 20, timeout=aiohttp.ClientTimeout(total=None))


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The id of the first model a server lists."""
    async with session.get(base_url + "/v1/models",
                           timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def send_one(session: aiohttp.ClientSession, target: Target, prompt: str,
                   spec: RequestSpec) -> RequestRecord:
    path = "/v1/chat/completions" if target.api == "chat" else "/v1/completions"
    rec = RequestRecord()
    start = time.perf_counter()
    answered = False
    try:
        # NOTE: target.timeout bounds the connect and each wait for bytes, not the whole
        # stream (as httpx's timeout did)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=target.timeout,
                                        sock_read=target.timeout)
        for attempt in range(2):
            try:
                async with session.post(target.base_url + path, timeout=timeout,
                                        json=request_body(target, prompt, spec)) as resp:
                    answered = True
                    if resp.status != 200:
                        await resp.read()
                        rec.error = f"http_{resp.status}"
                        return rec
                    await _read_stream(resp, rec, start)
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # NOTE: a pooled connection the server had closed (llama-server closes each
                # after a stream without saying so): sent again once on a new one, as the
                # openai SDK's retries do; the time lost stays in this request's TTFT
                if answered or attempt or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
    except TimeoutError:
        rec.error = "timeout"
    except aiohttp.ClientConnectorError:
        rec.error = "connect"
    except aiohttp.ClientError as exc:
        rec.error = type(exc).__name__
    except (ValueError, aiohttp.http_exceptions.HttpProcessingError):
        rec.error = "bad_stream"  # NOTE: e.g. an SSE line longer than the read buffer
    except asyncio.CancelledError:
        rec.error = "unfinished"  # NOTE: still running at the point's time bound
    rec.ok = rec.error is None
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    chunks = 0
    done = False
    async for raw in resp.content:  # NOTE: one line per item, its b"\n" kept
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec.error = "bad_json"
            return
        if "error" in obj:
            rec.error = "stream_error"
            return
        if obj.get("usage"):
            rec.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
            rec.output_tokens = obj["usage"].get("completion_tokens", 0)
        if any(_text(c) for c in obj.get("choices") or ()):
            now = time.perf_counter() - start
            rec.ttft = now if rec.ttft is None else rec.ttft
            rec.chunk_times.append(now)
            chunks += 1
    rec.e2e = time.perf_counter() - start
    if not done:
        rec.error = "no_done"
    if rec.output_tokens == 0:
        rec.output_tokens = chunks  # NOTE: servers without usage: one token per chunk
    if rec.ttft is None and rec.error is None:
        rec.error = "empty"


def _text(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


Jobs = Sequence[tuple[str, RequestSpec]]
Progress = Callable[[], None]


async def run_poisson(client: aiohttp.ClientSession, target: Target, jobs: Jobs, rate: float,
                      duration: float, drain: float, seed: int,
                      progress: Progress) -> tuple[list[RequestRecord], float]:
    """Open loop: sends at Poisson times (rate per second; inf sends all at once)."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[RequestRecord]] = []
    start = time.perf_counter()
    for prompt, spec in jobs:
        if time.perf_counter() - start > duration:
            break
        tasks.append(asyncio.create_task(_tracked(client, target, prompt, spec, progress)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    return await _gather(tasks, drain), time.perf_counter() - start


async def run_concurrency(client: aiohttp.ClientSession, target: Target, jobs: Jobs,
                          concurrency: int, duration: float, drain: float,
                          progress: Progress) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` workers, each sends its next request when the last one ends."""
    queue = list(reversed(jobs))
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def worker() -> None:
        while queue and time.perf_counter() - start <= duration:
            prompt, spec = queue.pop()
            records.append(await _tracked(client, target, prompt, spec, progress))

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    done, pending = await asyncio.wait(workers, timeout=duration + drain)
    for w in pending:
        w.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return records, time.perf_counter() - start


async def _tracked(client, target, prompt, spec, progress: Progress) -> RequestRecord:
    rec = await send_one(client, target, prompt, spec)
    progress()
    return rec


async def _gather(tasks: list[asyncio.Task[RequestRecord]], drain: float) -> list[RequestRecord]:
    if tasks:
        await asyncio.wait(tasks, timeout=drain)
    for t in tasks:
        t.cancel()
    return list(await asyncio.gather(*tasks))
