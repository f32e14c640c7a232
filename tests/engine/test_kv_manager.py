"""Block pool and KV manager bookkeeping, with exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from engine.sched.kv_manager import BlockPool, KVCacheManager
from engine.sched.request import Request
from ipc.prefix_hash import hash_block
from ipc.sampling import SamplingParams


def copies(kv: KVCacheManager) -> list[tuple[str, int, int]]:
    """The pending copies as (kind name, src, dst)."""
    return [(c.kind.name.lower(), c.src, c.dst) for c in kv.take_pending_copies()]


def make_request(num_prompt: int, rid: str = "r") -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(), max_tokens=16)


def test_pool_takes_in_order_and_refuses_without_side_effects():
    pool = BlockPool(4)
    assert pool.take(3) == [0, 1, 2]
    assert pool.take(2) is None
    assert pool.num_free == 1
    assert pool.take(1) == [3]


def test_released_blocks_go_to_the_back_of_the_free_queue():
    pool = BlockPool(4)
    a = pool.take(2)
    pool.release(a)
    assert pool.free_ids() == [2, 3, 0, 1]


def test_double_release_is_caught():
    pool = BlockPool(2)
    ids = pool.take(1)
    pool.release(ids)
    with pytest.raises(AssertionError):
        pool.release(ids)


def test_a_500_token_sequence_holds_exactly_32_blocks():
    kv = KVCacheManager(num_blocks=40, block_size=16)
    req = make_request(500)
    assert kv.allocate_slots(req, 500)
    assert len(kv.block_ids(req.key)) == 32 == -(-500 // 16)
    assert kv.block_ids(req.key) == list(range(32))
    assert kv.num_free_blocks == 8


def test_blocks_grow_one_at_a_time_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(4)
    assert kv.allocate_slots(req, 4)
    assert kv.block_ids(req.key) == [0]
    req.num_computed_tokens = 4
    assert kv.allocate_slots(req, 1)  # token 5 starts block 2
    assert kv.block_ids(req.key) == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 1)  # token 6 fits in block 2
    assert kv.block_ids(req.key) == [0, 1]


def test_out_of_blocks_takes_nothing_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request(8, "a"), make_request(8, "b")
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids(b.key) == [] and kv.num_free_blocks == 1
    kv.free(a)
    assert kv.block_ids(a.key) == [] and kv.num_free_blocks == 3
    # the freed request's tail block is queued before its head block
    assert kv.pool.free_ids() == [2, 1, 0]


# ---- prefix cache -------------------------------------------------------------------------


def make_tokens_request(tokens: list[int], rid: str = "r", salt: bytes = b"",
                        index: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16, cache_salt=salt, index=index)


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit as the scheduler does: cache hits, then compute the rest and register blocks."""
    hits = kv.find_cached_prefix(req)
    computed = len(hits) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - computed, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return hits


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"salt") != a


def test_shared_prefix_hits_full_blocks_only_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_tokens_request(list(range(10)), "a")  # blocks [0..3] [4..7] + partial
    assert run_prefill(kv, a) == []
    assert kv.block_ids(a.key) == [0, 1, 2]
    assert kv.pool.cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    b = make_tokens_request(list(range(8)) + [99, 98, 97], "b")
    assert run_prefill(kv, b) == [0, 1]
    assert kv.block_ids(b.key) == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    # a prompt that is exactly cached still computes its last block
    c = make_tokens_request(list(range(8)), "c")
    assert run_prefill(kv, c) == [0]
    assert kv.block_ids(c.key) == [0, 4]


def test_salt_separates_caches():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, make_tokens_request(list(range(9)), "a", b"tenant-1"))
    assert run_prefill(kv, make_tokens_request(list(range(9)), "b", b"tenant-2")) == []
    assert run_prefill(kv, make_tokens_request(list(range(9)), "c", b"tenant-1")) == [0, 1]


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_tokens_request([1, 2, 3, 4, 5], "a")  # blocks 0, 1 full; 2 partial
    b = make_tokens_request([7, 8, 9], "b")  # block 3 full; 4 partial
    run_prefill(kv, a)
    run_prefill(kv, b)
    kv.free(a)
    kv.free(b)
    # never-used block 5 first, then a's blocks tail first, then b's
    assert kv.pool.free_ids() == [5, 2, 1, 0, 4, 3]
    # a hit revives a cached free block: it leaves the free queue
    a2 = make_tokens_request([1, 2, 3, 4, 6], "a2")
    assert run_prefill(kv, a2) == [0, 1]
    assert kv.pool.free_ids() == [2, 4, 3]  # 5 was taken for a2's last block
    assert kv.block_ids(a2.key) == [0, 1, 5]
    # taking a cached block evicts its hash
    kv.free(a2)
    new = make_tokens_request(list(range(100, 106)), "n")
    run_prefill(kv, new)
    assert kv.block_ids(new.key) == [2, 4, 3]
    assert kv.pool.lookup(b.block_hashes[0]) is None  # b's block 3 was evicted
    assert [kv.pool.lookup(h) for h in new.block_hashes] == [2, 4, 3]
    assert kv.pool.lookup(a.block_hashes[0]) == 0  # a's head is still cached


def test_disabled_prefix_cache_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    run_prefill(kv, make_tokens_request(list(range(9)), "a"))
    assert run_prefill(kv, make_tokens_request(list(range(9)), "b")) == []
    assert kv.pool.cached == {}


# ---- copy-on-write and swap -------------------------------------------------------------


def test_fork_shares_the_partial_block_and_the_first_write_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_tokens_request(list(range(6)), "p")
    run_prefill(kv, parent)
    child = make_tokens_request(list(range(6)), "p", index=1)
    kv.fork(parent, child)
    assert kv.block_ids(child.key) == kv.block_ids(parent.key) == [0, 1]
    assert kv.pool.ref_cnt[:2] == [2, 2]
    child.num_computed_tokens = 6
    child.append_token(50)
    assert kv.allocate_slots(child, 1)  # writes position 6, in shared block 1
    assert kv.block_ids(child.key) == [0, 2]
    assert copies(kv) == [("gpu_to_gpu", 1, 2)]
    assert kv.pool.ref_cnt[:3] == [2, 1, 1]
    parent.append_token(60)
    assert kv.allocate_slots(parent, 1)  # now the parent owns block 1 alone: no copy
    assert kv.block_ids(parent.key) == [0, 1] and kv.take_pending_copies() == []


def test_swap_out_and_in_moves_blocks_between_pools():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=3)
    req = make_tokens_request(list(range(10)), "s")
    run_prefill(kv, req)
    assert kv.block_ids(req.key) == [0, 1, 2] and kv.can_swap_out(req)
    kv.swap_out(req)
    assert kv.block_ids(req.key) == [] and kv.cpu_block_ids(req.key) == [0, 1, 2]
    assert kv.num_free_blocks == 4 and kv.num_free_cpu_blocks == 0
    other = make_tokens_request([9] * 3, "o")
    assert kv.allocate_slots(other, 3)
    assert kv.block_ids(other.key) == [3]
    assert kv.swap_in(req)
    assert kv.block_ids(req.key) == [2, 1, 0] and kv.cpu_block_ids(req.key) == []
    assert copies(kv) == [
        ("gpu_to_cpu", 0, 0), ("gpu_to_cpu", 1, 1), ("gpu_to_cpu", 2, 2),
        ("cpu_to_gpu", 0, 2), ("cpu_to_gpu", 1, 1), ("cpu_to_gpu", 2, 0),
    ]
    assert kv.num_free_cpu_blocks == 3
