"""Data-parallel engines behind one gateway: one pair of sockets, one EngineClient per engine,
and a router that prefers the engine holding a request's prefix, else the least loaded one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec

from gateway.engine_client import EngineClient, EngineUnavailableError, RequestStream
from gateway.engine_sockets import SocketPump, ready_within
from ipc.config import EngineConfig
from ipc.engine_timeouts import EngineTimeouts
from ipc.messages import (
    AddRequest,
    EngineReady,
    EngineStats,
    FromEngine,
    Heartbeat,
    LoadLoraAdapter,
    LoraAdapterResult,
    UnloadLoraAdapter,
)
from ipc.prefix_hash import DIGEST_BYTES, prompt_block_hashes, unpack_digest
from ipc.transport import GatewaySockets

log = logging.getLogger("gateway.engine_pool")

_RECENT_S = 10.0  # how long a routed prompt counts as cached before the engine reports it


@dataclasses.dataclass(eq=False)
class _Member:
    """One engine slot and what the router knows of its prefix cache."""

    client: EngineClient
    cached: set[bytes] = dataclasses.field(default_factory=set)  # from its last heartbeat
    recent: dict[bytes, float] = dataclasses.field(default_factory=dict)  # routed here: time
    last_chosen: float = 0.0
    routed: int = 0  # requests sent to it (for tests and logs)

    def holds(self, key: bytes) -> bool:
        return key in self.cached or key in self.recent

    def prefix_blocks(self, keys: list[bytes]) -> int:
        """How many leading blocks of the prompt it (probably) has cached."""
        n = 0
        while n < len(keys) and self.holds(keys[n]):
            n += 1
        return n

    def free_slots(self) -> int:
        info = self.client.info
        limit = info.max_num_seqs if info is not None and info.max_num_seqs else 1 << 30
        return limit - self.client.num_inflight


class EnginePool:
    """`size` spawned engines (or, with spawn=False, every engine that attaches to the
    addresses), with the same interface as EngineClient for the gateway.

    Routing: the engine whose prefix cache holds at least `min_prefix_ratio` of the prompt's
    full blocks wins, unless it runs `max_imbalance` more requests than the least loaded engine;
    otherwise the engine with the most free slots, then most free KV blocks, then the one
    chosen least recently. A dead engine fails only its own requests.
    """

    def __init__(self, config: EngineConfig, *, size: int, spawn: bool = True,
                 input_addr: str | None = None, output_addr: str | None = None,
                 heartbeat_timeout: float = EngineTimeouts.heartbeat_timeout,
                 heartbeat_interval: float = EngineTimeouts.heartbeat_interval,
                 startup_timeout: float = EngineTimeouts.startup_timeout, restart: bool = True,
                 engine_command: Sequence[str] | None = None,
                 min_prefix_ratio: float = 0.5, max_imbalance: int = 4) -> None:
        if size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        self.config = config
        self.size = size
        self.spawn = spawn
        self.min_prefix_ratio = min_prefix_ratio
        self.max_imbalance = max_imbalance
        self._client_opts = dict(heartbeat_timeout=heartbeat_timeout,
                                 heartbeat_interval=heartbeat_interval,
                                 startup_timeout=startup_timeout, restart=restart,
                                 engine_command=engine_command)
        self.startup_timeout = startup_timeout
        self.members: list[_Member] = []
        self._pump = SocketPump(input_addr, output_addr, self._on_handshake, self._on_output)
        self._sockets: GatewaySockets | None = None
        self._first_ready = asyncio.Event()
        self._closing = False

    # ---- EngineClientLike ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(m.client.ready for m in self.members)

    @property
    def info(self) -> EngineReady | None:
        """The live engines as one: the first one's handshake, with the shortest context
        (each fits its own KV pool; a request must fit wherever it is routed) and the sum
        of their seats (max_num_seqs)."""
        infos = [m.client.info for m in self.members if m.client.ready and m.client.info]
        if not infos:
            return None
        return msgspec.structs.replace(
            infos[0], max_model_len=min(i.max_model_len for i in infos),
            max_num_seqs=sum(i.max_num_seqs for i in infos))

    @property
    def stats(self) -> EngineStats | None:
        """The sum of every live engine's latest stats."""
        all_stats = [m.client.stats for m in self.members if m.client.ready and m.client.stats]
        if not all_stats:
            return None
        return EngineStats(**{n: add_up([getattr(s, n) for s in all_stats])
                              for n in EngineStats.__struct_fields__})

    @property
    def engine_stats(self) -> list[tuple[str, EngineStats | None]]:
        """(name, latest stats) of each live engine, named by its slot (the live view's feed)."""
        return [(f"engine {i}", m.client.stats) for i, m in enumerate(self.members)
                if m.client.ready]

    @property
    def num_inflight(self) -> int:
        return sum(m.client.num_inflight for m in self.members)

    @property
    def last_error(self) -> str | None:
        errors = [m.client.last_error for m in self.members if m.client.last_error]
        return errors[-1] if errors else None

    @property
    def input_addr(self) -> str:
        assert self._sockets is not None, "start() first"
        return self._sockets.input_addr

    @property
    def output_addr(self) -> str:
        assert self._sockets is not None, "start() first"
        return self._sockets.output_addr

    def submit(self, msg: AddRequest) -> RequestStream:
        if self._closing:
            raise EngineUnavailableError("engine pool is shutting down")
        member = self._choose(msg)
        stream = member.client.submit(msg)
        member.routed += 1
        member.last_chosen = time.monotonic()
        for key in self._keys(msg):
            member.recent[key] = member.last_chosen
        return stream

    def abort(self, request_id: str) -> None:
        for m in self.members:
            m.client.abort(request_id)  # NOTE: a no-op on engines that do not run it

    def abort_choice(self, request_id: str, index: int) -> None:
        for m in self.members:
            m.client.abort_choice(request_id, index)  # NOTE: as abort

    async def lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterResult:
        """Load or unload an adapter on every live engine; the first refusal, else the last
        answer. NOTE: replicas read the same directory, so they refuse alike."""
        live = [m.client for m in self.members if m.client.ready]
        if not live:
            raise EngineUnavailableError(self.last_error or "no engine is ready")
        results = await asyncio.gather(*(c.lora(msg) for c in live))
        return next((r for r in results if r.error is not None), results[-1])

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind; spawn `size` engines and wait for all, or (attach) wait for the first."""
        self._sockets = self._pump.open()
        if self.spawn:
            self.members = [_Member(self._new_client(spawn=True)) for _ in range(self.size)]
            # NOTE: each spawned client times its own start
            ready: Awaitable[Any] = asyncio.gather(*(m.client.start() for m in self.members))
        else:
            ready = self._first_ready.wait()
        await ready_within(ready, None if self.spawn else self.startup_timeout,
                           "no engine attached", lambda: self.close(timeout=0))

    async def close(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        log.info("closing %d engines; requests routed to each: %s", len(self.members),
                 {m.client.incarnation: m.routed for m in self.members})
        await asyncio.gather(*(m.client.close(timeout) for m in self.members))
        await self._pump.close()

    # ---- routing ------------------------------------------------------------------------

    def _keys(self, msg: AddRequest) -> list[bytes]:
        info = self.info
        if info is None or not self.config.enable_prefix_caching:
            return []
        hashes = prompt_block_hashes(msg.prompt_token_ids, info.block_size, msg.cache_salt)
        return [h[:DIGEST_BYTES] for h in hashes]

    def _choose(self, msg: AddRequest) -> _Member:
        live = [m for m in self.members if m.client.ready]
        if not live:
            raise EngineUnavailableError(self.last_error or "no engine is ready")
        least_busy = min(m.client.num_inflight for m in live)
        keys = self._keys(msg)
        if keys:
            best = max(live, key=lambda m: m.prefix_blocks(keys))
            matched = best.prefix_blocks(keys)
            if (matched >= self.min_prefix_ratio * len(keys) and matched > 0
                    and best.client.num_inflight <= least_busy + self.max_imbalance):
                return best
        return max(live, key=_capacity)

    # ---- shared sockets -----------------------------------------------------------------

    def _new_client(self, *, spawn: bool) -> EngineClient:
        return EngineClient(self.config, spawn=spawn, sockets=self._sockets,
                            **self._client_opts)  # type: ignore[arg-type]

    def _on_handshake(self, identity: bytes, ready: EngineReady) -> None:
        if not self.spawn:
            # NOTE: a dead attached engine's slot goes: its requests have failed already,
            # and one that comes back (a restart, or a lapse that ended) is adopted anew.
            self.members = [m for m in self.members if not m.client.dead]
        owner = next((m for m in self.members
                      if m.client.incarnation == ready.incarnation), None)
        if owner is not None:
            owner.client.on_handshake(identity, ready)
        elif not self.spawn and not self._closing:
            self._adopt(identity, ready)
        if self.ready:
            self._first_ready.set()

    def _adopt(self, identity: bytes, ready: EngineReady) -> None:
        client = self._new_client(spawn=False)
        client.attach(identity, ready)
        self.members.append(_Member(client))
        log.info("engine %s attached (%d engines)", ready.incarnation, len(self.members))

    def _on_output(self, msg: FromEngine) -> None:
        for m in self.members:
            if m.client.incarnation == msg.incarnation:
                _note_cache(m, msg)
                m.client.on_output(msg)
                break


def add_up(values: list[Any]) -> Any:
    """Sum counters; lists (per-position counters) add element-wise."""
    if isinstance(values[0], list):
        return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)


def _capacity(m: _Member) -> tuple[int, int, float]:
    stats = m.client.stats
    return (m.free_slots(), stats.kv_blocks_free if stats else 0, -m.last_chosen)


def _note_cache(member: _Member, msg: FromEngine) -> None:
    if not isinstance(msg, Heartbeat) or member.client.dead:
        return
    member.cached = unpack_digest(msg.prefix_digest)
    horizon = time.monotonic() - _RECENT_S
    member.recent = {k: t for k, t in member.recent.items() if t > horizon}
