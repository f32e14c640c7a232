"""Grammar compilation off the busy loop: a small thread pool, an LRU cache of compiled grammars
by key, and a per-compile timeout. The scheduler polls a request's PendingGrammar each step."""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sched.structured.errors import GrammarError
from ipc.messages import GRAMMAR_COMPILE_BUCKETS
from ipc.sampling import StructuredOutputs

if TYPE_CHECKING:
    from engine.sched.structured.backend import Grammar


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (cache misses that finished)
    cache_hits: int = 0
    waited: int = 0  # requests that had to wait for their grammar
    failures: int = 0  # grammars refused or timed out
    compile_seconds_sum: float = 0.0
    # [i]: compiles that took <= GRAMMAR_COMPILE_BUCKETS[i]; the last entry is +Inf
    compile_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        first = bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, seconds)
        for i in range(first, len(self.compile_seconds_buckets)):
            self.compile_seconds_buckets[i] += 1


class _Compile:
    """One grammar's compilation, shared by every request with the same key."""

    def __init__(self, spec: StructuredOutputs) -> None:
        self.spec = spec
        self.future: Future[Grammar] = Future()
        self.started: float | None = None  # time.monotonic() a worker picked it up


class PendingGrammar:
    """A request's grammar while it compiles; `poll()` says when it is ready or failed."""

    def __init__(self, job: _Compile, timeout: float, stats: GrammarStats) -> None:
        self._job = job
        self._timeout = timeout
        self._stats = stats

    def poll(self) -> Grammar | GrammarError | None:
        """The grammar, the error that ends the request, or None while it still compiles."""
        job = self._job
        if job.future.done():
            error = job.future.exception()
            if error is None:
                return job.future.result()
            self._stats.failures += 1
            if isinstance(error, GrammarError):
                return error
            return GrammarError(f"invalid grammar: {error}", job.spec.param)
        if job.started is not None and time.monotonic() - job.started > self._timeout:
            self._stats.failures += 1
            return GrammarError(
                f"the grammar did not compile within {self._timeout:g} s "
                "(--structured-output-compile-timeout); simplify the schema", job.spec.param)
        return None

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for the compile (the loop has nothing else to do)."""
        try:
            self._job.future.exception(timeout=timeout)
        except TimeoutError:
            pass


class GrammarCompiler:
    """Compiles StructuredOutputs specs on worker threads, caching grammars by spec key.

    NOTE: llguidance drops the GIL while it compiles, so the busy loop keeps stepping. It is
    imported on the first compile: an engine that never sees a grammar never loads it.
    """

    def __init__(self, make_tokenizer: Callable[[], Any], timeout: float,
                 cache_size: int = 256, workers: int = 2, close_on_budget: bool = True) -> None:
        """close_on_budget: grammars' matchers close within their request's max_tokens
        (engine/sched/grammar.py); off, a reply cut by max_tokens may end inside the JSON."""
        self._make_tokenizer = make_tokenizer
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on the first compile
        self._close_on_budget = close_on_budget
        self._closer: Any = None  # closing.Closer over that tokenizer, built with it
        self._tokenizer_lock = threading.Lock()
        self._timeout = timeout
        self._cache: OrderedDict[tuple, _Compile] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self.stats = GrammarStats()

    def submit(self, spec: StructuredOutputs) -> PendingGrammar:
        job = self._cache.get(spec.key)
        if job is not None:
            self._cache.move_to_end(spec.key)
            self.stats.cache_hits += 1
        else:
            job = _Compile(spec)
            self._cache[spec.key] = job
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._pool.submit(self._compile, job)
        if not job.future.done():
            self.stats.waited += 1
        return PendingGrammar(job, self._timeout, self.stats)

    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
                if self._close_on_budget:
                    from engine.sched.structured.closing import Closer  # NOTE: llguidance, lazily

                    self._closer = Closer(self._tokenizer)
            return self._tokenizer

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, job: _Compile) -> None:
        from engine.sched.structured.backend import (  # NOTE: llguidance, lazily
            Grammar,
            grammar_text,
        )

        try:
            tokenizer = self.tokenizer()
            job.started = time.monotonic()
            grammar = Grammar(tokenizer, grammar_text(job.spec), job.spec.param, self._closer)
        except Exception as exc:  # NOTE: any failure is the request's, reported by poll()
            job.future.set_exception(exc)
            return
        self.stats.observe(time.monotonic() - job.started)
        job.future.set_result(grammar)

