"""A request's scheduling state inside the engine: tokens, progress and how it finished (its
block table is the KV manager's, its row state the runner's, both by `key`)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.step_plan import choice_key
from ipc.messages import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    PositionLogprobs,
)
from ipc.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.sched.structured.backend import Matcher
    from engine.sched.structured.compiler import PendingGrammar


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # its grammar compiles on a worker thread; not yet queued
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FINISH_STOP,
    RequestStatus.FINISHED_LENGTH: FINISH_LENGTH,
    RequestStatus.FINISHED_ABORTED: FINISH_ABORT,
    RequestStatus.FINISHED_ERROR: FINISH_ERROR,
}

_arrival_counter = itertools.count()


@dataclass
class Closing:
    """A choice's budget-closing state; engine/sched/grammar.py alone writes it."""

    length: int | None = None  # the closing's length from the last planned state; None: none fits
    forced: bool = False  # the closing is being forced now
    # (output tokens, closing): the closing found from the state after that many outputs
    after: tuple[int, list[int] | None] = (-1, None)
    refused_at: int | None = None  # the output position whose sampled token was refused


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        priority: int = 0,
        arrival_time: float = 0.0,
        cache_salt: bytes = b"",
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.sampling = sampling
        self.max_tokens = max_tokens  # resolved: never None here
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(prompt_token_ids)
        self._all_token_ids = list(prompt_token_ids)
        self.index = index  # which of the request's n choices this is
        self.key = choice_key(request_id, index)  # this choice's id in the KV manager, runner
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks so far
        self.cache_salt = cache_salt  # extra key: only requests with the same salt share blocks
        self.lora_id: int | None = None  # its LoRA adapter (engine/run/lora), None: the base model
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.scheduled_time: float | None = None  # time.time() of the first admission
        self.cumulative_logprob = 0.0  # sum of the sampled tokens' logprobs (best_of, beams)
        self.children: list[Request] = []  # the other n - 1 choices, forked after the prompt
        self.beam_candidates: list[tuple[int, float]] | None = None  # (token, logprob), top 2k
        # EOS and stop_token_ids unless ignore_eos: set once at admission (engine/sched/stopping.py)
        self.end_token_ids: frozenset[int] = frozenset()
        self.stop_reason: int | None = None
        # with sampling.prompt_logprobs, on choice 0 (the one that computes the prompt): those
        # computed so far (prompt tokens 1 ..), until they are sent with its first token
        self.prompt_logprobs: list[PositionLogprobs] | None = (
            [] if sampling.prompt_logprobs is not None and index == 0 else None)
        self.prompt_logprobs_sent = False
        # structured outputs: the grammar while it compiles, then this choice's matcher (which
        # consumes every output token, so it survives preemption by swap and by recompute)
        self.pending_grammar: PendingGrammar | None = None
        self.grammar: Matcher | None = None
        self.closing = Closing()  # budget closing's state (engine/sched/grammar.py)
        self.error: str | None = None  # with FINISHED_ERROR: why
        self.pooled: list[float] | None = None  # a pooling request's vector, once computed
        self.error_param: str | None = None  # and the request field at fault
        self.num_preemptions = 0
        # the timeline reported on the terminal delta (RequestMetrics)
        self.first_token_time: float | None = None
        self.finished_time = 0.0
        self.num_lost_tokens = 0  # computed tokens dropped by a recompute preemption, pending
        self.num_recomputed_tokens = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        # priority first, then arrival; the counter breaks ties in submission order
        self.sort_key = (priority, arrival_time, next(_arrival_counter))

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self._all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self.num_prompt_tokens

    @property
    def seed(self) -> int | None:
        """The seed of this choice's own generator: choice i samples with seed + i."""
        s = self.sampling.seed
        return None if s is None else s + self.index

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def prompt_logprob_positions(self, start: int, n: int) -> range:
        """Of the n positions computed from `start`, those whose logits give a prompt token's
        logprob not yet computed (position i predicts prompt token i + 1)."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return range(0)
        first = max(start, len(self.prompt_logprobs))
        return range(first, min(start + n, self.num_prompt_tokens - 1))

    def resume_from(self, num_cached: int) -> None:
        """Admitted with its first num_cached tokens found in the prefix cache."""
        self.num_computed_tokens = num_cached
        if self.num_output_tokens == 0:
            self.num_cached_tokens = num_cached
        self.num_recomputed_tokens += max(0, self.num_lost_tokens - num_cached)
        self.num_lost_tokens = 0

    def follow(self, parent: Request) -> None:
        """Forked from `parent` (n > 1, beams): it shares the parent's progress."""
        self.scheduled_time = parent.scheduled_time
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_tokens = parent.num_cached_tokens

    def append_token(self, token_id: int) -> None:
        self._all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = f"the sampled token {token_id} broke the grammar: {self.grammar.error}"
        if self.first_token_time is None:
            self.first_token_time = time.time()

    def become_copy_of(self, other: Request) -> None:
        """Take another beam's tokens (the scheduler shares its blocks): a beam fork."""
        self._all_token_ids = list(other._all_token_ids)
        self.block_hashes = list(other.block_hashes)
        self.cumulative_logprob = other.cumulative_logprob
        self.first_token_time = other.first_token_time
