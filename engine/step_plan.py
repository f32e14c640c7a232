"""The scheduler <-> runner contract for one step, as plain data (msgspec structs of ints,
lists, bytes and enums): the scheduler's StepPlan, the runner's draft proposals and its
RunnerOutput. Both sides import only this; tensor-parallel ranks receive the plan encoded.

NOTE: gc=False: these hold only ints, strings, bytes, lists and other plan structs, never a
reference back, so they cannot be in a cycle; untracked, a step's hundreds of them do not bring
on garbage collections in the busy loop.

Modelled on vLLM v1's SchedulerOutput: a request (one choice of it, named by its key) is sent
in full once (NewRequest), then as diffs (CachedRequest). The runner keeps what it was sent
(tokens, block table, generator) until the key is in `finished_keys`.
"""

from __future__ import annotations

import enum

import msgspec

from ipc.messages import PositionLogprobs
from ipc.sampling import SamplingParams


def choice_key(request_id: str, index: int) -> str:
    """The engine's id of one choice of a request: the request id for choice 0, else
    `{index}_{request id}` (vLLM's child ids). The engine refuses a request whose keys are live."""
    return request_id if index == 0 else f"{index}_{request_id}"


class CopyKind(enum.IntEnum):
    GPU_TO_GPU = 0  # copy-on-write: a shared block about to be written
    GPU_TO_CPU = 1  # swap out
    CPU_TO_GPU = 2  # swap in


class BlockCopy(msgspec.Struct, array_like=True, frozen=True, gc=False):
    kind: CopyKind
    src: int  # block id in the source pool (device pool, or the CPU pool for CPU_TO_GPU)
    dst: int  # block id in the destination pool


class Diff(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Edit of a list the runner mirrors: keep its first `start` entries, then append `values`
    (an append is start == the old length; a rewrite from 0 replaces the list)."""

    start: int
    values: list[int]


class NewRequest(msgspec.Struct, frozen=True, gc=False):
    """A choice the runner has not seen: everything it needs, once."""

    key: str  # choice_key(request_id, index)
    token_ids: list[int]  # prompt + output tokens so far
    num_prompt_tokens: int  # the first tokens of token_ids that are the prompt
    sampling: SamplingParams
    seed: int | None  # its own generator's seed (request seed + choice index); None: shared
    block_ids: list[int]  # its block table (NULL_BLOCK = -1 entries lie before a window)
    num_computed_tokens: int  # tokens whose K/V are in the cache (prefix-cache hits count)
    # the tokens that end it (EOS unless ignore_eos, and stop_token_ids), sorted: the scheduler
    # stops on them; the sampler bans them before min_tokens
    end_token_ids: list[int] = []
    lora: int | None = None  # its LoRA adapter's id (engine/run/lora), None: the base model


class CachedRequest(msgspec.Struct, frozen=True, gc=False):
    """What changed for a choice the runner already holds, since it was last in a plan.

    A choice resumed after preemption (swapped back in, or readmitted to be recomputed) keeps
    its row (tokens, generator); its table comes back as a rewrite from 0."""

    key: str
    tokens: Diff | None  # its token ids (None: unchanged); a beam fork rewrites them
    block_ids: Diff | None  # its block table (None: unchanged); swap-in/CoW/window rewrite
    num_computed_tokens: int


class SampleRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    key: str  # the choice that samples a token this step
    logits_key: str  # whose last position's logits it samples: itself, or (n > 1) its parent


class GrammarMask(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Allowed tokens at a choice's sampling positions: int32 [rows, ceil(vocab / 32)] in
    little-endian bytes, bit t of a row set = token t allowed. Row i masks the position after
    i verified draft tokens; positions past `rows` (after a draft the grammar refuses) are
    left unmasked: that draft has probability 0, so verification stops before them."""

    rows: int
    words: int
    data: bytes


class PromptLogprobsSpan(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Positions start..stop-1 of a choice give prompt logprobs (position i predicts token
    i + 1), each with its top `k`."""

    start: int
    stop: int
    k: int


class StepPlan(msgspec.Struct, gc=False):
    """One step, decided by the scheduler. The runner applies the request entries, runs the
    block copies, then computes num_scheduled_tokens[key] tokens for each key (in its own
    order, decodes first)."""

    step: int  # counts plans; the runner applies a plan's diffs once
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    # key -> tokens to compute this step (prompt chunk, one decode token, or 1 + drafts), in
    # scheduling order; keys absent compute nothing
    num_scheduled_tokens: dict[str, int] = {}
    # key -> draft tokens verified this step (the last ones of its scheduled tokens)
    spec_token_ids: dict[str, list[int]] = {}
    # key -> gamma: the runner's own draft (self or draft model) proposes these first
    # (Runner.propose); the scheduler then fills spec_token_ids and their grammar masks
    self_drafts: dict[str, int] = {}
    sampling: list[SampleRow] = []  # choices that sample one token, in order
    grammar_masks: dict[str, GrammarMask] = {}  # by sampling key, for choices with a grammar
    prompt_logprobs: dict[str, PromptLogprobsSpan] = {}
    block_copies: list[BlockCopy] = []  # run before the forward, in order
    # preempted this step (swapped out or to be recomputed); for the record (bench, logs): the
    # runner keeps their rows; a resumed choice comes back as diffs (its new block table, and
    # num_computed_tokens from 0 after a recompute)
    preempted_keys: list[str] = []
    finished_keys: list[str] = []  # finished since the last plan: the runner drops them
    # of num_scheduled_tokens, those before the end of each key's prompt (the engine's
    # prompt-token count; drafts and decode tokens are not prompt)
    num_prompt_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


class DraftProposals(msgspec.Struct, gc=False):
    """Runner.propose's answer: key -> the draft tokens it proposed (gamma each)."""

    token_ids: dict[str, list[int]] = {}


class Sampled(msgspec.Struct, array_like=True, gc=False):
    token_id: int  # the token sampled after the accepted drafts
    accepted: list[int]  # the draft tokens verification kept ([] without drafts)
    logprobs: PositionLogprobs | None  # when the choice asked (or best_of / beams need it)


class RunnerOutput(msgspec.Struct, gc=False):
    sampled: dict[str, Sampled] = {}  # by key, one per SampleRow
    prompt_logprobs: dict[str, list[PositionLogprobs]] = {}  # by key, in position order
    # by key: the vector of a pooling row whose prompt ended this step (engine/run/pooling.py)
    pooled: dict[str, list[float]] = {}


def decode_first(plan: StepPlan) -> list[str]:
    """The runner's batch order: one-token queries first, then the rest, each in plan order."""
    counts = plan.num_scheduled_tokens
    return [k for k in counts if counts[k] == 1] + [k for k in counts if counts[k] != 1]
