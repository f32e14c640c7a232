"""Paged KV block accounting: block pools with ref counts, the prefix cache, copy-on-write,
forks and CPU swap. Pure CPU bookkeeping; the tensors live in the runner's caches.

A block is either free (in its pool's free queue, ref count 0) or referenced by the block
tables that hold it (ref count = number of tables). Full blocks are registered in the prefix
cache under a hash chain and stay there, even when free, until their block is reused.

Block tables belong here, by choice key (engine.step_plan.choice_key): the scheduler asks for
them by key; what the runner holds of them is the runner mirror's (engine/sched/mirror.py).

Sliding windows: when every layer of the model attends within a window, the blocks wholly
before the window of a request's next query are released (to the back of the free queue:
still in the prefix cache until reused) and their table entries become NULL_BLOCK, so a long
request holds about window / block_size + 1 blocks however long it grows. A model with any
global layer (Gemma 2/3 mix local and global layers) keeps every block: the layers share one
block table, and the global layers read every token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.sched.request import Request
from engine.step_plan import BlockCopy, CopyKind

# NOTE: in ipc, so the gateway routes by the same hashes
from ipc.prefix_hash import BlockHash, extend_block_hashes

NULL_BLOCK = -1  # a table entry whose block was released: it lies before the window
_NO_TABLE: list[int] = []  # NOTE: what table() returns for a choice holding none; never written


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
        self.pending_copies: list[BlockCopy] = []  # block copies decided this step, in order
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found
        self._tables: dict[str, list[int]] = {}  # key -> block table (device pool)
        self._cpu_tables: dict[str, list[int]] = {}  # key -> its table while swapped out
        self._registered: dict[str, int] = {}  # key -> leading blocks in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free if self.cpu_pool else 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    # ---- tables by key ---------------------------------------------------------------------

    def block_ids(self, key: str) -> list[int]:
        """A copy of the choice's block table ([] when it holds none)."""
        return list(self._tables.get(key, ()))

    def cpu_block_ids(self, key: str) -> list[int]:
        """A copy of its table in the CPU pool ([] unless swapped out)."""
        return list(self._cpu_tables.get(key, ()))

    def table(self, key: str) -> Sequence[int]:
        """The choice's block table as it is now, not a copy: read it, never keep it."""
        return self._tables.get(key, _NO_TABLE)

    def num_blocks(self, key: str) -> int:
        return len(self._tables.get(key, ()))

    def is_swapped(self, key: str) -> bool:
        return key in self._cpu_tables

    def _set_table(self, key: str, table: list[int]) -> None:
        if table:
            self._tables[key] = table
        else:
            self._tables.pop(key, None)

    # ---- sizes -----------------------------------------------------------------------------

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
        if self.window is None:
            return
        table = self._tables.get(req.key, [])
        n = min(self.out_of_window(req.num_computed_tokens), len(table))
        old = held(table[:n])
        if old:
            self.pool.release(old)
            table[:n] = [NULL_BLOCK] * n

    # ---- prefix cache ----------------------------------------------------------------------

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                                   req.cache_salt)

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
        table = self._tables.get(req.key, [])
        computed = min(req.num_computed_tokens, req.num_tokens)
        full = min(computed // self.block_size, len(table))
        registered = self._registered.get(req.key, 0)
        if full <= registered:
            return  # NOTE: the common case (a decode inside a block): nothing to hash
        hashes = self.block_hashes(req)
        for i in range(registered, full):
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], hashes[i])
        self._registered[req.key] = full

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Room for num_new_tokens more K/V entries after `cached_blocks` (prefix-cache hits,
        only for a request holding no blocks). False, with nothing taken, if out of blocks."""
        if not cached_blocks and self.window is None and self._fits(req, num_new_tokens):
            return True  # NOTE: the common decode step: room in its last block, not shared
        cached_blocks = cached_blocks or []
        if not cached_blocks:
            self.drop_out_of_window(req)
        table = self._tables.get(req.key, [])
        computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        holding = len(table) + len(cached_blocks)
        need = max(0, self.blocks_needed(computed + num_new_tokens) - holding)
        cow = self._shared_write_block(table, computed) if num_new_tokens else None
        reviving = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        if need + (cow is not None) > self.pool.num_free - reviving:
            return False
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if cow is not None:
            self._copy_on_write(table, cow)
        if need:
            table.extend(self.pool.take(need) or [])
        if table:
            self._tables[req.key] = table
        return True

    def _fits(self, req: Request, num_new_tokens: int) -> bool:
        """The request's table already has room for the tokens, and its first block to be
        written is its own."""
        table = self._tables.get(req.key)
        if table is None:
            return False
        computed = req.num_computed_tokens
        if computed + num_new_tokens > len(table) * self.block_size:
            return False
        idx = computed // self.block_size
        return not num_new_tokens or idx >= len(table) or self.pool.ref_cnt[table[idx]] <= 1

    def _shared_write_block(self, table: list[int], computed: int) -> int | None:
        """Index in the table of the first block to be written, if other tables share it."""
        idx = computed // self.block_size
        if idx < len(table) and self.pool.ref_cnt[table[idx]] > 1:
            return idx
        return None

    def _copy_on_write(self, table: list[int], idx: int) -> None:
        (fresh,) = self.pool.take(1)
        old = table[idx]
        self.pending_copies.append(BlockCopy(CopyKind.GPU_TO_GPU, old, fresh))
        self.pool.release([old])
        table[idx] = fresh

    def trim(self, req: Request) -> None:
        """Give back blocks past the computed tokens (the slots of rejected draft tokens)."""
        table = self._tables.get(req.key, [])
        keep = self.blocks_needed(req.num_computed_tokens)
        if len(table) > keep:
            self.pool.release(list(reversed(table[keep:])))
            del table[keep:]
            if not table:
                del self._tables[req.key]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (the last partial one too)."""
        assert child.key not in self._tables
        table = self._tables.get(parent.key, [])
        self.pool.share(table)
        self._set_table(child.key, list(table))
        self._registered[child.key] = self._registered.get(parent.key, 0)

    def free(self, req: Request) -> None:
        # NOTE: tail first, so a chain's tail is evicted before its head.
        self.pool.release(list(reversed(self._tables.pop(req.key, []))))
        self._registered.pop(req.key, None)
        cpu = self._cpu_tables.pop(req.key, None)
        if cpu and self.cpu_pool:
            self.cpu_pool.release(held(cpu))

    # ---- swap ------------------------------------------------------------------------------

    def can_swap_out(self, req: Request) -> bool:
        table = self._tables.get(req.key, [])
        return self.cpu_pool is not None and len(held(table)) <= self.cpu_pool.num_free

    def swap_out(self, req: Request) -> None:
        """Move the request's blocks to the CPU pool (the copies run before the next forward).
        NULL_BLOCK entries stay in place in the CPU table."""
        assert self.cpu_pool is not None
        table = self._tables.pop(req.key, [])
        gpu = held(table)
        cpu = self.cpu_pool.take(len(gpu))
        assert cpu is not None, "check can_swap_out() first"
        self.pending_copies += [BlockCopy(CopyKind.GPU_TO_CPU, g, c)
                                for g, c in zip(gpu, cpu, strict=True)]
        self.pool.release(list(reversed(gpu)))
        self._cpu_tables[req.key] = _refill(table, cpu)
        self._registered.pop(req.key, None)

    def blocks_to_swap_in(self, req: Request, num_new_tokens: int) -> int:
        """GPU blocks a swapped request needs to resume with num_new_tokens more."""
        table = self._cpu_tables[req.key]
        grow = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table)
        return len(held(table)) + max(0, grow)

    def swap_in(self, req: Request) -> bool:
        """Bring a swapped request's blocks back; False (nothing taken) if no room."""
        assert self.cpu_pool is not None and req.key in self._cpu_tables
        cpu = held(self._cpu_tables[req.key])
        gpu = self.pool.take(len(cpu))
        if gpu is None:
            return False
        self.pending_copies += [BlockCopy(CopyKind.CPU_TO_GPU, c, g)
                                for c, g in zip(cpu, gpu, strict=True)]
        self.cpu_pool.release(cpu)
        self._set_table(req.key, _refill(self._cpu_tables.pop(req.key), gpu))
        return True

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies


def _refill(table: list[int], blocks: list[int]) -> list[int]:
    """`table` with its real entries replaced, in order, by `blocks` (NULL_BLOCK kept)."""
    it = iter(blocks)
    return [b if b == NULL_BLOCK else next(it) for b in table]
