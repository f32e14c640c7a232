"""EngineClient against the real `python -m engine`: a tiny random Llama, and the bundled model."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import tokenizers

# NOTE: a plain import, not importorskip: `make test` installs the engine, so an ImportError
# in it must fail these tests, not skip them
import engine.core  # noqa: F401
from gateway.engine_client import EngineClient, RequestStream
from ipc.config import EngineConfig
from ipc.messages import AddRequest, TokenDelta
from ipc.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)


def _config(model: Path | None) -> EngineConfig:
    return EngineConfig(model=None if model is None else str(model), device="cpu",
                        num_gpu_blocks=64, max_model_len=256, num_threads=1)


def _client(model: Path | None, **kwargs: object) -> EngineClient:
    opts: dict[str, object] = dict(heartbeat_timeout=10.0, heartbeat_interval=0.2,
                                   startup_timeout=120.0)
    opts.update(kwargs)
    return EngineClient(_config(model), **opts)  # type: ignore[arg-type]


def _add(rid: str, max_tokens: int, prompt: tuple[int, ...] = (1, 2, 3)) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=list(prompt),
                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def _collect(stream: RequestStream, timeout: float = 60.0) -> list[TokenDelta]:
    async def run() -> list[TokenDelta]:
        return [d async for d in stream]

    return await asyncio.wait_for(run(), timeout)


def _tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


async def _until_kv_free(client: EngineClient) -> None:
    for _ in range(200):
        stats = client.stats
        if stats is not None and stats.num_running == 0 and stats.kv_blocks_free == 64:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"KV not freed: {client.stats}")


async def test_real_engine_streams_aborts_and_drains_on_sigterm(tiny_model_dir: Path) -> None:
    client = _client(tiny_model_dir, restart=False)
    await client.start()
    try:
        info = client.info
        assert info is not None and info.max_model_len == 256 and info.num_gpu_blocks == 64
        assert (Path(info.tokenizer) / "tokenizer.json").is_file()

        first = await _collect(client.submit(_add("a", 5)))
        again = await _collect(client.submit(_add("b", 5)))
        assert len(_tokens(first)) == 5 and _tokens(first) == _tokens(again)
        assert first[-1].finish_reason == "length" and first[0].num_prompt_tokens == 3

        long = client.submit(_add("long", 200))
        await anext(long)
        client.abort("long")
        assert (await _collect(long))[-1].finish_reason == "abort"
        await _until_kv_free(client)

        rejected = await _collect(client.submit(_add("too-long", 5, prompt=(1,) * 300)))
        assert rejected[-1].finish_reason == "error" and "context length" in rejected[-1].error

        draining = client.submit(_add("drain", 200))
        await anext(draining)
        assert client.pid is not None
        os.kill(client.pid, signal.SIGTERM)
        deltas = await _collect(draining)
        assert deltas[-1].finish_reason == "length"  # in-flight work finishes
        assert client._proc is not None and await client._proc.wait() == 0
    finally:
        await client.close(timeout=2)


async def test_real_engine_kill_9_then_restart(tiny_model_dir: Path) -> None:
    client = _client(tiny_model_dir)
    await client.start()
    try:
        streams = [client.submit(_add(f"r{i}", 200)) for i in range(2)]
        for stream in streams:
            await anext(stream)
        assert client.pid is not None
        os.kill(client.pid, signal.SIGKILL)
        for stream in streams:
            last = (await _collect(stream))[-1]
            assert last.finish_reason == "error" and last.error.startswith("engine died:")
        assert not client.ready
        await client.wait_ready(timeout=120)
        assert client.restarts == 1
        assert (await _collect(client.submit(_add("after", 3))))[-1].finish_reason == "length"
    finally:
        await client.close(timeout=2)


async def test_real_engine_hang_is_detected(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_DEBUG_HANG_AFTER_STEPS", "3")
    client = _client(tiny_model_dir, heartbeat_timeout=1.5, restart=False)
    await client.start()
    try:
        deltas = await _collect(client.submit(_add("r", 100)))
        assert len(_tokens(deltas)) == 3
        assert deltas[-1].finish_reason == "error" and "no heartbeat" in deltas[-1].error
        assert not client.ready
    finally:
        await client.close(timeout=1)


async def test_bundled_model_streams_and_closes_cleanly() -> None:
    client = _client(None)
    await client.start()
    try:
        assert client.info is not None and client.info.model == "SmolLM2-135M-Instruct"
        tok = tokenizers.Tokenizer.from_file(str(Path(client.info.tokenizer) / "tokenizer.json"))
        prompt = tuple(tok.encode("The capital of France is").ids)
        deltas = await _collect(client.submit(_add("hi", 6, prompt=prompt)))
        assert 1 <= len(_tokens(deltas)) <= 6 and deltas[-1].finish_reason in ("length", "stop")
        assert tok.decode(_tokens(deltas)).strip()
    finally:
        await client.close(timeout=5)
    assert client._proc is not None and client._proc.returncode == 0
