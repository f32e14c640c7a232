"""Sliding-window block release in the KV manager, with exact block ids: blocks wholly before
the next query's window go back to the free queue (still prefix-cached), swap and fork keep the
NULL_BLOCK entries in place, and a growing request's block count stays bounded."""

from __future__ import annotations

from engine.sched.kv_manager import NULL_BLOCK, KVCacheManager
from engine.sched.request import Request
from ipc.sampling import SamplingParams


def copies(kv: KVCacheManager) -> list[tuple[str, int, int]]:
    """The pending copies as (kind name, src, dst)."""
    return [(c.kind.name.lower(), c.src, c.dst) for c in kv.take_pending_copies()]


def make_request(num_prompt: int, rid: str = "r") -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(), max_tokens=1000)


def grow(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def test_blocks_before_the_window_are_released_in_order():
    kv = KVCacheManager(num_blocks=10, block_size=4, window=6)
    req = make_request(20)
    grow(kv, req, 20)  # one chunk: all 5 blocks at once
    assert kv.block_ids(req.key) == [0, 1, 2, 3, 4]
    # the next query sits at 20 and sees keys 15..20: blocks 0-2 (keys 0..11) are behind it
    assert kv.allocate_slots(req, 1)
    assert kv.block_ids(req.key) == [NULL_BLOCK] * 3 + [3, 4, 5]
    assert kv.pool.free_ids() == [6, 7, 8, 9, 0, 1, 2]
    # released full blocks stay in the prefix cache until reused
    assert kv.find_cached_prefix(make_request(20, "b")) == [0, 1, 2, 3]


def test_a_growing_request_holds_a_bounded_number_of_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6, enable_prefix_caching=False)
    req = make_request(1)
    most = 0
    for _ in range(500):  # 500 tokens would need 125 blocks without the window
        grow(kv, req, 1)
        most = max(most, len([b for b in kv.block_ids(req.key) if b != NULL_BLOCK]))
    assert most <= kv.max_blocks_held(10**6, 1) == 3
    kv.free(req)
    assert kv.num_free_blocks == 8


def test_no_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request(20)
    grow(kv, req, 20)
    assert kv.allocate_slots(req, 1)
    assert kv.block_ids(req.key) == [0, 1, 2, 3, 4, 5]
    assert kv.max_blocks_held(40, 8) == 10


def test_swap_keeps_released_entries_in_place():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_cpu_blocks=4, window=6)
    req = make_request(20)
    grow(kv, req, 20)
    assert kv.allocate_slots(req, 1)  # [N, N, N, 3, 4, 5]
    kv.swap_out(req)
    assert kv.cpu_block_ids(req.key) == [NULL_BLOCK] * 3 + [0, 1, 2]
    assert copies(kv) == [("gpu_to_cpu", 3, 0), ("gpu_to_cpu", 4, 1),
                                        ("gpu_to_cpu", 5, 2)]
    assert kv.blocks_to_swap_in(req, 1) == 3
    assert kv.swap_in(req)
    table = kv.block_ids(req.key)
    assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.num_free_cpu_blocks == 4


def test_fork_and_copy_on_write_with_released_entries():
    kv = KVCacheManager(num_blocks=10, block_size=4, window=6)
    parent, child = make_request(22, "p"), make_request(22, "c")
    grow(kv, parent, 22)
    assert kv.allocate_slots(parent, 0)  # the next query (22) sees 17..22: blocks 0-3 go
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens  # as the scheduler's fork
    assert kv.block_ids(child.key) == [NULL_BLOCK] * 4 + [4, 5]
    assert kv.allocate_slots(child, 1)  # writes into the shared partial block: a copy
    assert copies(kv) == [("gpu_to_gpu", 5, 6)]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10


def test_the_bench_counts_fewer_blocks_with_window_freeing():
    from bench.kv_memory import window_freeing

    r = window_freeing(window=64, total_tokens=1024, block_size=16, chunk=32, prompt_len=100)
    assert r["no_freeing"]["peak_blocks"] == 64
    assert r["freeing"]["peak_blocks"] <= r["freeing"]["bound"] == 7  # (63 + 32) / 16 + 1
