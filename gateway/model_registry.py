"""Several models behind one gateway: a name -> engine pool table that the request's `model`
picks from, which loads and unloads models at run time and looks, to what serves every model
at once (health, metrics, drain), like one engine client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.engine_client import EngineClient, EngineUnavailableError, RequestStream
from gateway.engine_pool import EnginePool, add_up
from gateway.lora_registry import LoraRegistry
from gateway.model_specs import ModelSpec
from ipc.config import EngineConfig
from ipc.messages import AddRequest, EngineReady, EngineStats

log = logging.getLogger("gateway.model_registry")

Engines = EngineClient | EnginePool
EngineFactory = Callable[[ModelSpec], Engines]


class UnknownModelError(KeyError):
    """No model (or adapter) is served under this name."""


class NameTakenError(ValueError):
    """A model's or an adapter's name is in use; `param` is the field that gave it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class ServedModel:
    spec: ModelSpec
    engines: Engines
    created: int = field(default_factory=lambda: int(time.time()))  # when it was loaded
    loras: LoraRegistry = field(init=False)  # its engines' adapters: gone with the model

    def __post_init__(self) -> None:
        config = self.spec.config
        self.loras = LoraRegistry.from_modules(config.enable_lora, config.lora_modules)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pids(self) -> list[int]:
        """The engine processes this gateway spawned for the model (alive or not)."""
        clients = [m.client for m in self.engines.members] \
            if isinstance(self.engines, EnginePool) else [self.engines]
        return [c.pid for c in clients if c.pid is not None]

    def resident_bytes(self) -> int:
        """The resident memory of its live engine processes (Linux /proc; 0 elsewhere)."""
        return sum(_rss(pid) for pid in self.pids)


class ModelRegistry:
    """The served models, in the order they were given (the first is the default for requests
    that name none), each with its LoRA adapters: a name is a model's or one adapter's."""

    def __init__(self, specs: list[ModelSpec], factory: EngineFactory,
                 base: EngineConfig | None = None) -> None:
        """`base`: the engine options a model loaded at run time starts from."""
        self._factory = factory
        self.base = base or EngineConfig()
        self.models: dict[str, ServedModel] = {s.name: ServedModel(s, factory(s)) for s in specs}
        self.known: dict[str, ModelSpec] = {s.name: s for s in specs}  # for a reload by name
        self.busy: dict[str, str] = {}  # name -> "loading" | "unloading"
        self._starting: dict[str, ServedModel] = {}  # loading: closed too if the server stops
        self._closing = False

    # ---- lookup -------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ServedModel:
        """The model serving `name` (None or "": the default); UnknownModelError otherwise."""
        if not name:
            if not self.models:
                raise UnknownModelError("no model is loaded")
            return next(iter(self.models.values()))
        served = self.models.get(name) or self.parent_of(name)
        if served is None:
            raise UnknownModelError(name)
        return served

    def parent_of(self, adapter: str) -> ServedModel | None:
        """The model one of whose adapters is named `adapter`."""
        return next((m for m in self.models.values() if adapter in m.loras.paths), None)

    def holder(self, name: str) -> str | None:
        """What has `name` now: a model (loaded, loading or unloading) or an adapter of one."""
        if name in self.models or name in self.busy:
            return f"the model `{name}`"
        parent = next((m for m in (*self.models.values(), *self._starting.values())
                       if m.loras.holds(name)), None)
        return None if parent is None else f"an adapter of the model `{parent.name}`"

    # ---- run-time loading ---------------------------------------------------------------

    async def load(self, spec: ModelSpec) -> ServedModel:
        """Start `spec`'s engines and serve it once they are ready (NameTakenError if its name
        or one of its adapters' is in use; EngineUnavailableError if they fail to start)."""
        if self._closing:
            raise EngineUnavailableError("the server is shutting down")
        self._check_names(spec)
        served = ServedModel(spec, self._factory(spec))
        self.busy[spec.name] = "loading"
        self._starting[spec.name] = served
        try:
            await served.engines.start()
        finally:
            del self.busy[spec.name], self._starting[spec.name]
        if self._closing:  # NOTE: the server began to stop while its engines started
            await served.engines.close(timeout=0)
            raise EngineUnavailableError("the server is shutting down")
        self.models[spec.name] = served
        self.known[spec.name] = spec
        return served

    def _check_names(self, spec: ModelSpec) -> None:
        """NameTakenError if `spec`'s name or one of its adapters' is in use."""
        if spec.name in self.models or spec.name in self.busy:
            raise NameTakenError(f"a model named `{spec.name}` is loaded already (or loading)",
                                 "model")
        for name in (spec.name, *spec.adapters):
            held = self.holder(name)
            if held is not None:
                what = "" if name == spec.name else f" of the model `{spec.name}`"
                kind = "model" if name == spec.name else "adapter"
                raise NameTakenError(f"the {kind} `{name}`{what} has the name of {held}",
                                     "model" if name == spec.name else "lora_modules")

    async def unload(self, name: str, timeout: float = 0.0) -> ServedModel:
        """Stop routing to `name` at once, give its requests `timeout` s to finish, abort the
        rest (each ends with its terminal delta) and wait for its engine processes to exit."""
        served = self.models.pop(name, None)
        if served is None:
            raise UnknownModelError(name)
        self.busy[name] = "unloading"
        try:
            await served.engines.close(timeout=timeout)
        finally:
            del self.busy[name]
        log.info("model %s unloaded (engine pids %s)", name, served.pids)
        return served

    def model_stats(self) -> list[tuple[str, EngineStats | None]]:
        """(name, its engines' summed stats) per served model (metrics labelled model_name)."""
        return [(name, m.engines.stats) for name, m in self.models.items()]

    # ---- one engine client for what serves every model ----------------------------------

    @property
    def ready(self) -> bool:
        return any(m.engines.ready for m in self.models.values())

    @property
    def info(self) -> EngineReady | None:
        """The default model's handshake (the first ready one's while it starts)."""
        infos = [m.engines.info for m in self.models.values() if m.engines.ready]
        return next((i for i in infos if i is not None), None)

    @property
    def stats(self) -> EngineStats | None:
        all_stats = [s for _, s in self.model_stats() if s is not None]
        if not all_stats:
            return None
        return EngineStats(**{n: add_up([getattr(s, n) for s in all_stats])
                              for n in EngineStats.__struct_fields__})

    @property
    def engine_stats(self) -> list[tuple[str, EngineStats | None]]:
        return [(f"{name} {engine}", stats) for name, m in self.models.items()
                for engine, stats in m.engines.engine_stats]

    @property
    def num_inflight(self) -> int:
        return sum(m.engines.num_inflight for m in self.models.values())

    @property
    def last_error(self) -> str | None:
        errors = [m.engines.last_error for m in self.models.values() if m.engines.last_error]
        return errors[-1] if errors else None

    def submit(self, msg: AddRequest) -> RequestStream:
        """To the default model (a gateway view of one model submits to that model's own)."""
        try:
            return self.resolve(None).engines.submit(msg)
        except UnknownModelError:
            raise EngineUnavailableError("no model is loaded") from None

    def abort(self, request_id: str) -> None:
        for m in list(self.models.values()):
            m.engines.abort(request_id)  # NOTE: a no-op on engines that do not run it

    def abort_choice(self, request_id: str, index: int) -> None:
        for m in list(self.models.values()):
            m.engines.abort_choice(request_id, index)

    async def start(self) -> None:
        """Start every model's engines together; one that fails stops them all."""
        results = await asyncio.gather(*(m.engines.start() for m in self.models.values()),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close(timeout=0)
            raise failed[0]

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        serving = [*self.models.values(), *self._starting.values()]
        await asyncio.gather(*(m.engines.close(timeout) for m in serving))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass  # NOTE: the process is gone (or no /proc): it holds no memory we can count
    return 0
