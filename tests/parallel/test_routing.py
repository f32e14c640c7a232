"""EnginePool's routing rule on stand-in engines: prefix affinity, its limits, free capacity."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engine_pool import EnginePool, _Member, _note_cache
from ipc.config import EngineConfig
from ipc.messages import AddRequest, EngineReady, EngineStats, Heartbeat
from ipc.prefix_hash import pack_digest, prompt_block_hashes
from ipc.sampling import SamplingParams


@dataclass
class _Engine:
    """The parts of EngineClient the router reads."""

    incarnation: str
    num_inflight: int = 0
    kv_free: int = 100
    ready: bool = True
    dead: bool = False
    max_model_len: int = 512  # as the engine reports it: what its own KV pool holds

    @property
    def info(self) -> EngineReady:
        return EngineReady(model="m", max_model_len=self.max_model_len, block_size=4,
                           num_gpu_blocks=100, max_num_seqs=8)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_free=self.kv_free)


def _pool(*engines: _Engine) -> EnginePool:
    pool = EnginePool(EngineConfig(), size=len(engines))
    pool.members = [_Member(e) for e in engines]  # type: ignore[arg-type]
    return pool


def _req(prompt: list[int]) -> AddRequest:
    return AddRequest(request_id="r", prompt_token_ids=prompt, sampling=SamplingParams())


def _report(member: _Member, prompt: list[int]) -> None:
    digest = pack_digest(prompt_block_hashes(prompt, 4))
    _note_cache(member, Heartbeat(step=1, queue_depth=0, prefix_digest=digest,
                                  incarnation=member.client.incarnation))


def test_most_free_slots_then_kv_then_least_recent() -> None:
    a, b = _Engine("a", num_inflight=3), _Engine("b", num_inflight=1)
    pool = _pool(a, b)
    assert pool._choose(_req([1] * 16)).client is b
    b.num_inflight = 3
    a.kv_free = 200
    assert pool._choose(_req([1] * 16)).client is a
    a.kv_free = 100
    pool.members[1].last_chosen = 5.0  # b was chosen more recently
    assert pool._choose(_req([1] * 16)).client is a


def test_prefix_affinity_from_reports_within_limits() -> None:
    a, b = _Engine("a"), _Engine("b", num_inflight=2)
    pool = _pool(a, b)
    system = list(range(100, 124))  # 6 blocks of 4
    _report(pool.members[1], system)
    assert pool._choose(_req(system + [7, 8, 9, 10])).client is b  # 6 of 7 blocks cached
    assert pool._choose(_req(system[:4] + list(range(500, 528)))).client is a  # 1 of 8: no
    b.num_inflight = 5  # 5 more than a: over max_imbalance=4
    assert pool._choose(_req(system + [7, 8, 9, 10])).client is a
    b.ready = False
    assert pool._choose(_req(system)).client is a


def test_a_routed_prompt_counts_as_cached_until_reported() -> None:
    a, b = _Engine("a"), _Engine("b")
    pool = _pool(a, b)
    a.submit = b.submit = lambda msg: msg  # type: ignore[attr-defined]  # NOTE: no engine
    prompt = list(range(40))
    first = pool._choose(_req(prompt))
    pool.submit(_req(prompt))
    assert first.routed == 1 and pool._choose(_req(prompt)) is first


def test_the_pool_reports_the_shortest_context_and_every_seat() -> None:
    pool = _pool(_Engine("a", max_model_len=512), _Engine("b", max_model_len=96),
                 _Engine("c", max_model_len=64, ready=False))
    info = pool.info
    assert info is not None and (info.max_model_len, info.max_num_seqs) == (96, 16)
