"""EnginePool with real tiny-model engines: load sharing, prefix affinity, attach over tcp, and
one engine dying while the other keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# NOTE: a plain import, not importorskip: `make test` installs the engine, so an ImportError
# in it must fail these tests, not skip them
import engine.core  # noqa: F401
from gateway.engine_client import RequestStream
from gateway.engine_pool import EnginePool
from ipc.config import EngineConfig
from ipc.messages import AddRequest, TokenDelta
from ipc.prefix_hash import hash_block, pack_digest, prompt_block_hashes, unpack_digest
from ipc.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", num_gpu_blocks=64, max_model_len=256,
                        num_threads=1)


def _add(rid: str, prompt: list[int], max_tokens: int = 4) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=prompt,
                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def _collect(stream: RequestStream, timeout: float = 60.0) -> list[TokenDelta]:
    async def run() -> list[TokenDelta]:
        return [d async for d in stream]

    return await asyncio.wait_for(run(), timeout)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def _routed(pool: EnginePool) -> list[int]:
    return [m.routed for m in pool.members]


def test_prefix_hashes_match_the_engine() -> None:
    from engine.sched import kv_manager
    from engine.sched.request import Request
    from ipc.prefix_hash import extend_block_hashes, salt_bytes

    assert kv_manager.extend_block_hashes is extend_block_hashes  # one chain, one salt rule
    hashes = prompt_block_hashes(list(range(40)), 16, "salt")
    req = Request("r", list(range(40)), SamplingParams(), 1, cache_salt=salt_bytes("salt"))
    assert kv_manager.KVCacheManager(4, 16).block_hashes(req) == hashes
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], list(range(16, 32)), b"salt")
    assert unpack_digest(pack_digest(hashes)) == {h[:8] for h in hashes}


async def test_two_engines_share_load_and_keep_prefix_affinity(tiny_model_dir: Path) -> None:
    pool = EnginePool(_config(tiny_model_dir), size=2, heartbeat_interval=0.2,
                      heartbeat_timeout=20.0, startup_timeout=120.0, restart=False)
    await pool.start()
    rng = random.Random(0)
    try:
        assert pool.ready and len(pool.members) == 2
        streams = [pool.submit(_add(f"load{i}", _prompt(rng, 20))) for i in range(8)]
        for deltas in await asyncio.gather(*(_collect(s) for s in streams)):
            assert deltas[-1].finish_reason == "length"
        assert _routed(pool) == [4, 4]  # NOTE: equal load, no shared prefix: alternates

        system = _prompt(rng, 96)  # 6 full blocks shared by every request below
        first = pool.submit(_add("sys0", system + _prompt(rng, 8)))
        await _collect(first)
        home = max(range(2), key=lambda i: pool.members[i].routed - 4)
        for m in pool.members:
            m.recent.clear()  # NOTE: route from what the engines report, not what we sent
        await asyncio.sleep(0.6)  # a few heartbeats
        assert pool.members[home].cached and not pool.members[1 - home].cached & {
            h[:8] for h in prompt_block_hashes(system, 16)}
        for i in range(1, 5):
            before = _routed(pool)
            other = await _collect(pool.submit(_add(f"other{i}", _prompt(rng, 40))))
            deltas = await _collect(pool.submit(_add(f"sys{i}", system + _prompt(rng, 8))))
            after = _routed(pool)
            assert after[home] - before[home] >= 1, (before, after)
            assert deltas[0].num_cached_tokens == 96  # its engine already had the prefix
            assert other[-1].finish_reason == "length"
        assert pool.stats is not None and pool.stats.prefix_cache_hits > 0
    finally:
        await pool.close(timeout=5)


async def test_attached_engines_over_tcp_survive_one_dying(tiny_model_dir: Path) -> None:
    # NOTE: nothing watches an attached engine's process: its death shows as a heartbeat lapse.
    pool = EnginePool(_config(tiny_model_dir), size=2, spawn=False, heartbeat_timeout=4.0,
                      startup_timeout=120.0, input_addr="tcp://127.0.0.1:*",
                      output_addr="tcp://127.0.0.1:*")
    starting = asyncio.create_task(pool.start())
    await asyncio.sleep(0)  # NOTE: start() binds before its first await: the ports are known
    engines = [_engine(tiny_model_dir, pool, f"attached{i}") for i in range(2)]
    try:
        await starting
        for _ in range(1200):
            if sum(m.client.ready for m in pool.members) == 2:
                break
            await asyncio.sleep(0.1)
        assert sum(m.client.ready for m in pool.members) == 2
        rng = random.Random(1)
        streams = [pool.submit(_add(f"long{i}", _prompt(rng, 20), max_tokens=200))
                   for i in range(4)]
        # NOTE: kill once every stream has its first token, not after a fixed sleep: a fast
        # machine finishes 200 tokens of the tiny model in well under a second.
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams)), 60)
        victim = pool.members[0].client.incarnation
        proc = next(p for p, inc in engines if inc == victim)
        proc.send_signal(signal.SIGKILL)
        rests = await asyncio.gather(*(_collect(s, 120.0) for s in streams))
        results = [[first, *rest] for first, rest in zip(firsts, rests, strict=True)]
        reasons = sorted(r[-1].finish_reason or "" for r in results)
        assert reasons == ["error", "error", "length", "length"], reasons
        for i in range(3):  # the survivor takes all new work
            deltas = await _collect(pool.submit(_add(f"after{i}", _prompt(rng, 20))))
            assert deltas[-1].finish_reason == "length"
    finally:
        await pool.close(timeout=5)
        for proc, _ in engines:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _engine(model: Path, pool: EnginePool, incarnation: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "engine", *_config(model).to_cli_args(),
            "--input-addr", pool.input_addr, "--output-addr", pool.output_addr,
            "--incarnation", incarnation, "--heartbeat-interval", "0.2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL), incarnation
