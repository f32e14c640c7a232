"""Paged KV block accounting: a fixed pool of blocks, per-request block tables, ref counts.

Pure CPU bookkeeping; the tensors themselves live in the runner's KV cache.
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockPool:
    """Fixed set of block ids with reference counts and a free queue (oldest freed first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def take(self, n: int) -> list[int] | None:
        """n fresh blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self.ref_cnt[i] = 1
        return ids

    def release(self, ids: list[int]) -> None:
        for i in ids:
            assert self.ref_cnt[i] > 0, f"block {i} released twice"
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self._free.append(i)


class KVCacheManager:
    """Grows and frees the block tables of requests; never holds a block beyond its need."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more K/V entries; False (nothing taken) if out of blocks."""
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(request.block_ids)
        if need <= 0:
            return True
        ids = self.pool.take(need)
        if ids is None:
            return False
        request.block_ids.extend(ids)
        return True

    def free(self, request: Request) -> None:
        # NOTE: released tail first, so the free queue keeps a request's head blocks longest
        # (the prefix cache will evict from the front of this queue).
        self.pool.release(list(reversed(request.block_ids)))
        request.block_ids = []
