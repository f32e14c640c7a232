"""Block pool and KV manager bookkeeping, with exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from engine.kv_manager import BlockPool, KVCacheManager
from engine.request import Request
from ipc.sampling import SamplingParams


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
    assert len(req.block_ids) == 32 == -(-500 // 16)
    assert req.block_ids == list(range(32))
    assert kv.num_free_blocks == 8


def test_blocks_grow_one_at_a_time_on_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(4)
    assert kv.allocate_slots(req, 4)
    assert req.block_ids == [0]
    req.num_computed_tokens = 4
    assert kv.allocate_slots(req, 1)  # token 5 starts block 2
    assert req.block_ids == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 1)  # token 6 fits in block 2
    assert req.block_ids == [0, 1]


def test_out_of_blocks_takes_nothing_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request(8, "a"), make_request(8, "b")
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 3
    # the freed request's tail block is queued before its head block
    assert kv.pool.free_ids() == [2, 1, 0]
