"""Property-based tests of the KV manager: random allocate / decode / fork / cache hits /
eviction / swap / free sequences keep every invariant after every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.sched.kv_manager import KVCacheManager
from engine.sched.request import Request
from ipc.sampling import SamplingParams

BLOCK = 4
GPU_BLOCKS = 12
CPU_BLOCKS = 6


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(GPU_BLOCKS, BLOCK, num_cpu_blocks=CPU_BLOCKS)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.next_id = 0

    def _new(self, tokens: list[int]) -> Request:
        self.next_id += 1
        return Request(str(self.next_id), tokens, SamplingParams(), max_tokens=64)

    # NOTE: a small alphabet and shared prefixes make prefix-cache hits common.
    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def admit(self, prefix, tail):
        req = self._new(prefix + tail)
        hits = self.kv.find_cached_prefix(req)
        computed = len(hits) * BLOCK
        if self.kv.allocate_slots(req, req.num_tokens - computed, hits):
            req.num_computed_tokens = req.num_tokens
            self.kv.cache_full_blocks(req)
            self.running.append(req)
        else:
            assert self.kv.block_ids(req.key) == []

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        req = data.draw(st.sampled_from(self.running))
        req.append_token(token)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
            self.kv.cache_full_blocks(req)
        else:
            req.all_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = self._new(list(parent.all_token_ids))
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.kv.free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        req = data.draw(st.sampled_from(self.running))
        if self.kv.can_swap_out(req):
            self.kv.swap_out(req)
            self.running.remove(req)
            self.swapped.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        req = data.draw(st.sampled_from(self.swapped))
        if self.kv.swap_in(req):
            self.swapped.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        req = data.draw(st.sampled_from(self.swapped))
        self.swapped.remove(req)
        self.kv.free(req)

    @invariant()
    def ref_counts_match_block_tables(self):
        gpu = [self.kv.block_ids(r.key) for r in self.running]
        cpu = [self.kv.cpu_block_ids(r.key) for r in self.swapped]
        for pool, tables in ((self.kv.pool, gpu), (self.kv.cpu_pool, cpu)):
            held = Counter(b for table in tables for b in table)
            free = set(pool.free_ids())
            for block in range(pool.num_blocks):
                assert pool.ref_cnt[block] == held[block]
                assert (block in free) == (held[block] == 0)  # free xor referenced
            assert len(free) + len(held) == pool.num_blocks

    @invariant()
    def tables_cover_computed_tokens(self):
        for r in self.running:
            assert len(self.kv.block_ids(r.key)) == -(-r.num_computed_tokens // BLOCK)

    @invariant()
    def cached_blocks_point_back(self):
        pool = self.kv.pool
        for h, block in pool.cached.items():
            assert pool.block_hash[block] == h

    def teardown(self):
        for r in self.running + self.swapped:
            self.kv.free(r)
        assert self.kv.num_free_blocks == GPU_BLOCKS
        assert self.kv.num_free_cpu_blocks == CPU_BLOCKS
        assert all(c == 0 for c in self.kv.pool.ref_cnt)


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManagerProperties = KVMachine.TestCase
