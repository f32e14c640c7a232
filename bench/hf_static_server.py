"""BASELINE, not pagedserve: static batching over HF `generate` behind an OpenAI-style API.

    python -m bench.hf_static_server --port 8100 [--model PATH] [--batch-size 8]

One batch runs at a time and ends when its longest member does; requests that arrive meanwhile
wait. It exists only so bench.serve can put the same load on the naive design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers.generation.streamers import BaseStreamer

from bench.hf_baseline import generate_batch, load_model
from ipc.model_source import resolve_model

LABEL = "hf-static-baseline"


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    # token ids, then a finish reason (str) or the exception that ended the batch
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    count: int = 0
    done: bool = False


class RowStreamer(BaseStreamer):
    """Routes each step's [B] new tokens to the rows' queues (generate's own streamers take B=1)."""

    def __init__(self, jobs: list[Job], eos_ids: set[int], loop: asyncio.AbstractEventLoop):
        self.jobs, self.eos_ids, self.loop = jobs, eos_ids, loop
        # NOTE: ignore_eos holds for a batch only if every member asks for it; otherwise
        # generate pads a row after its EOS, so every row stops there.
        self.ignore_eos = all(j.ignore_eos for j in jobs)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # NOTE: generate's first put is the prompt batch
            self.prompt_seen = True
            return
        for job, token in zip(self.jobs, value.view(-1).tolist(), strict=True):
            if job.done:
                continue
            if token in self.eos_ids and not self.ignore_eos:
                self._finish(job, "stop")
                continue
            job.count += 1
            self.loop.call_soon_threadsafe(job.queue.put_nowait, token)
            if job.count >= job.max_tokens:
                self._finish(job, "length")

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                self._finish(job, "length")

    def fail(self, exc: Exception) -> None:
        for job in self.jobs:
            if not job.done:
                job.done = True
                self.loop.call_soon_threadsafe(job.queue.put_nowait, exc)

    def _finish(self, job: Job, reason: str) -> None:
        job.done = True
        self.loop.call_soon_threadsafe(job.queue.put_nowait, reason)


class StaticBatcher:
    """Takes up to `batch_size` queued jobs, runs them as one `generate`, repeats."""

    def __init__(self, model, tokenizer, batch_size: int, batch_wait: float) -> None:
        self.model, self.tok = model, tokenizer
        self.batch_size, self.batch_wait = batch_size, batch_wait
        self.pending: asyncio.Queue[Job] = asyncio.Queue()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.pending.get()]
            if self.batch_wait > 0:
                await asyncio.sleep(self.batch_wait)
            while len(batch) < self.batch_size and not self.pending.empty():
                batch.append(self.pending.get_nowait())
            streamer = RowStreamer(batch, self.eos_ids, loop)
            # NOTE: one sampling setting per static batch: its first request's temperature.
            try:
                await asyncio.to_thread(
                    generate_batch, self.model, [j.prompt_ids for j in batch],
                    max(j.max_tokens for j in batch), self.pad, streamer.ignore_eos,
                    batch[0].temperature, streamer)
            except Exception as exc:  # NOTE: fail this batch's requests, keep serving
                streamer.fail(exc)


def build_app(batcher: StaticBatcher, model_name: str) -> Starlette:
    tok = batcher.tok

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "server": LABEL})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": LABEL}]})

    async def completions(request: Request) -> Response:
        return await _handle(request, chat=False)

    async def chat(request: Request) -> Response:
        return await _handle(request, chat=True)

    async def _handle(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
            ids = _prompt_ids(tok, body, chat)
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"invalid request: {exc}")
        job = Job(ids, int(body.get("max_tokens") or 16), float(body.get("temperature", 1.0)),
                  bool(body.get("ignore_eos", False)))
        await batcher.pending.put(job)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}",
                "created": int(time.time()), "model": model_name}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(tok, job, meta, chat, usage),
                                     media_type="text/event-stream")
        whole = await _whole(tok, job, meta, chat)
        return whole if isinstance(whole, Response) else JSONResponse(whole)

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]

    async def lifespan(_app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    return Starlette(routes=routes, lifespan=lifespan)


def _prompt_ids(tok, body: dict, chat: bool) -> list[int]:
    if chat:
        return list(tok.apply_chat_template(body["messages"], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
    prompt = body["prompt"]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    if not isinstance(prompt, str):
        raise TypeError("prompt must be a string or a list of token ids")
    return tok(prompt, add_special_tokens=False)["input_ids"]


async def _tokens(tok, job: Job) -> AsyncIterator[tuple[str, str | None]]:
    """(new text, finish reason or None); text held back while it ends in a partial character."""
    ids: list[int] = []
    sent = ""
    while True:
        item = await job.queue.get()
        if isinstance(item, Exception):
            raise item
        if isinstance(item, str):
            yield tok.decode(ids, skip_special_tokens=True)[len(sent):], item
            return
        ids.append(item)
        text = tok.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > len(sent):
            yield text[len(sent):], None
            sent = text


def _choice(chat: bool, text: str, finish: str | None, stream: bool) -> dict:
    if chat:
        key = "delta" if stream else "message"
        content = {"content": text} if stream else {"role": "assistant", "content": text}
        return {"index": 0, key: content, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


def _usage(job: Job) -> dict:
    n, p = job.count, len(job.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


async def _sse(tok, job: Job, meta: dict, chat: bool, usage: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    try:
        async for text, finish in _tokens(tok, job):
            chunk = {**meta, "object": obj, "choices": [_choice(chat, text, finish, True)]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    except Exception as exc:
        yield f"data: {json.dumps(_error_body(f'generation failed: {exc}'))}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    if usage:
        tail = {**meta, "object": obj, "choices": [], "usage": _usage(job)}
        yield f"data: {json.dumps(tail)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _whole(tok, job: Job, meta: dict, chat: bool) -> dict | Response:
    parts, reason = [], None
    try:
        async for text, finish in _tokens(tok, job):
            parts.append(text)
            reason = finish
    except Exception as exc:
        return _error(500, f"generation failed: {exc}")
    obj = "chat.completion" if chat else "text_completion"
    return {**meta, "object": obj, "choices": [_choice(chat, "".join(parts), reason, False)],
            "usage": _usage(job)}


def _error_body(message: str, kind: str = "server_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


def _error(status: int, message: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(_error_body(message, kind), status_code=status)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hf_static_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled)")
    p.add_argument("--batch-size", type=int, default=8, help="static batch size B")
    p.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="wait this long after the first request for the batch to fill")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    model, tok = load_model(args.model)
    batcher = StaticBatcher(model, tok, args.batch_size, args.batch_wait_ms / 1000)
    print(f"{LABEL}: static batches of {args.batch_size} (a baseline, not pagedserve)", flush=True)
    uvicorn.run(build_app(batcher, resolve_model(args.model).name), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
