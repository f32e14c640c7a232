"""Paged KV block accounting: block pools with ref counts, the prefix cache, copy-on-write,
forks and CPU swap. Pure CPU bookkeeping; the tensors live in the runner's caches.

A block is either free (in its pool's free queue, ref count 0) or referenced by the block
tables that hold it (ref count = number of tables). Full blocks are registered in the prefix
cache under a hash chain and stay there, even when free, until their block is reused.

Sliding windows: when every layer of the model attends within a window, the blocks wholly
before the window of a request's next query are released (to the back of the free queue:
still in the prefix cache until reused) and their table entries become NULL_BLOCK, so a long
request holds about window / block_size + 1 blocks however long it grows. A model with any
global layer (Gemma 2/3 mix local and global layers) keeps every block: the layers share one
block table, and the global layers read every token.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request
from ipc.prefix_hash import BlockHash, hash_block  # NOTE: in ipc, so the gateway routes by it

NULL_BLOCK = -1  # a table entry whose block was released: it lies before the window


def held(block_ids: list[int]) -> list[int]:
    """The real blocks of a table (NULL_BLOCK entries left out)."""
    return [b for b in block_ids if b != NULL_BLOCK]


class BlockPool:
    """Fixed set of block ids, ref counts, and a free queue in eviction order (front first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # prefix cache: hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def take(self, n: int) -> list[int] | None:
        """n blocks from the front of the free queue (evicting their cache entries), or None."""
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            ids.append(block)
        return ids

    def touch(self, ids: list[int]) -> None:
        """Reference blocks found in the prefix cache (taking free ones out of the queue)."""
        for block in ids:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def share(self, ids: list[int]) -> None:
        """One more table holds these (referenced) blocks: forks."""
        for block in held(ids):
            assert self.ref_cnt[block] > 0, f"block {block} is free"
            self.ref_cnt[block] += 1

    def release(self, ids: list[int]) -> None:
        for block in held(ids):
            assert self.ref_cnt[block] > 0, f"block {block} released twice"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None

    def register(self, block: int, block_hash: BlockHash) -> None:
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None


class KVCacheManager:
    """Grows, shares, swaps and frees block tables; never holds a block beyond its need."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        window: int | None = None,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError("window must be >= 1")
        self.block_size = block_size
        # every layer's window (the widest), when all layers have one: older blocks are dropped
        self.window = window
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.enable_prefix_caching = enable_prefix_caching
        # block copies decided this step, in order: (kind, src, dst)
        self.pending_copies: list[tuple[str, int, int]] = []
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free if self.cpu_pool else 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of num_tokens holds at once, computed `chunk` tokens at
        a time at most: all of them, or with a window the window's and one chunk's."""
        if self.window is None:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens),
                   self.blocks_needed(self.window - 1 + chunk) + 1)

    def out_of_window(self, num_computed: int) -> int:
        """How many leading blocks no query from position num_computed on can see: a query
        at p reads keys p - window + 1 .. p."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def drop_out_of_window(self, req: Request) -> None:
        """Release the blocks before the window of the request's next query."""
        n = min(self.out_of_window(req.num_computed_tokens), len(req.block_ids))
        old = held(req.block_ids[:n])
        if old:
            self.pool.release(old)
            req.block_ids[:n] = [NULL_BLOCK] * n

    # ---- prefix cache ----------------------------------------------------------------------

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        bs, hashes, tokens = self.block_size, req.block_hashes, req.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], req.cache_salt))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in self.block_hashes(req)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # NOTE: accepted draft tokens count as computed before they are appended: only
        # blocks of known tokens are hashed now, the rest on a later call.
        computed = min(req.num_computed_tokens, req.num_tokens)
        full = min(computed // self.block_size, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        hashes = self.block_hashes(req)
        for i in range(req.num_registered_blocks, full):
            if req.block_ids[i] != NULL_BLOCK:
                self.pool.register(req.block_ids[i], hashes[i])
        req.num_registered_blocks = full

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Room for num_new_tokens more K/V entries after `cached_blocks` (prefix-cache hits,
        only for a request holding no blocks). False, with nothing taken, if out of blocks."""
        cached_blocks = cached_blocks or []
        if not cached_blocks:
            self.drop_out_of_window(req)
        computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        held = len(req.block_ids) + len(cached_blocks)
        need = max(0, self.blocks_needed(computed + num_new_tokens) - held)
        cow = self._shared_write_block(req, computed) if num_new_tokens else None
        reviving = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        if need + (cow is not None) > self.pool.num_free - reviving:
            return False
        self.pool.touch(cached_blocks)
        req.block_ids.extend(cached_blocks)
        if cow is not None:
            self._copy_on_write(req, cow)
        req.block_ids.extend(self.pool.take(need) or [])
        return True

    def _shared_write_block(self, req: Request, computed: int) -> int | None:
        """Index in the table of the first block to be written, if other tables share it."""
        idx = computed // self.block_size
        if idx < len(req.block_ids) and self.pool.ref_cnt[req.block_ids[idx]] > 1:
            return idx
        return None

    def _copy_on_write(self, req: Request, idx: int) -> None:
        (fresh,) = self.pool.take(1)
        old = req.block_ids[idx]
        self.pending_copies.append(("gpu_to_gpu", old, fresh))
        self.pool.release([old])
        req.block_ids[idx] = fresh

    def trim(self, req: Request) -> None:
        """Give back blocks past the computed tokens (the slots of rejected draft tokens)."""
        keep = self.blocks_needed(req.num_computed_tokens)
        if len(req.block_ids) > keep:
            self.pool.release(list(reversed(req.block_ids[keep:])))
            del req.block_ids[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (the last partial one too)."""
        assert not child.block_ids
        self.pool.share(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, req: Request) -> None:
        # NOTE: tail first, so a chain's tail is evicted before its head.
        self.pool.release(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_registered_blocks = 0
        if req.cpu_block_ids and self.cpu_pool:
            self.cpu_pool.release(req.cpu_block_ids)
            req.cpu_block_ids = []

    # ---- swap ------------------------------------------------------------------------------

    def can_swap_out(self, req: Request) -> bool:
        return self.cpu_pool is not None and len(held(req.block_ids)) <= self.cpu_pool.num_free

    def swap_out(self, req: Request) -> None:
        """Move the request's blocks to the CPU pool (the copies run before the next forward).
        NULL_BLOCK entries stay in place in the CPU table."""
        assert self.cpu_pool is not None
        gpu = held(req.block_ids)
        cpu = self.cpu_pool.take(len(gpu))
        assert cpu is not None, "check can_swap_out() first"
        self.pending_copies += [("gpu_to_cpu", g, c) for g, c in zip(gpu, cpu, strict=True)]
        self.pool.release(list(reversed(gpu)))
        req.cpu_block_ids = _refill(req.block_ids, cpu)
        req.block_ids = []
        req.num_registered_blocks = 0

    def blocks_to_swap_in(self, req: Request, num_new_tokens: int) -> int:
        """GPU blocks a swapped request needs to resume with num_new_tokens more."""
        table = req.cpu_block_ids
        grow = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table)
        return len(held(table)) + max(0, grow)

    def swap_in(self, req: Request) -> bool:
        """Bring a swapped request's blocks back; False (nothing taken) if no room."""
        assert self.cpu_pool is not None and req.cpu_block_ids
        cpu = held(req.cpu_block_ids)
        gpu = self.pool.take(len(cpu))
        if gpu is None:
            return False
        self.pending_copies += [("cpu_to_gpu", c, g) for c, g in zip(cpu, gpu, strict=True)]
        self.cpu_pool.release(cpu)
        req.block_ids = _refill(req.cpu_block_ids, gpu)
        req.cpu_block_ids = []
        return True

    def take_pending_copies(self) -> list[tuple[str, int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies


def _refill(table: list[int], blocks: list[int]) -> list[int]:
    """`table` with its real entries replaced, in order, by `blocks` (NULL_BLOCK kept)."""
    it = iter(blocks)
    return [b if b == NULL_BLOCK else next(it) for b in table]
