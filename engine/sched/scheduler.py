"""Continuous batching by token budget: every request catches its computed tokens up to its
tokens, so chunked prefill, prefix-cache hits and decode are one rule. Preemption (swap or
recompute) is what happens when the KV manager cannot make room.

The scheduler owns that rule and its verbs (admit, allocate, preempt, fork, finish, abort); the
policies beside it decide, and it applies their decisions: speculation.py (drafts), beams.py,
grammar.py (masks, budget closing), stopping.py, preemption.py (swap or recompute).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.sched import beams
from engine.sched.deltas import beam_deltas, delta
from engine.sched.grammar import Grammars
from engine.sched.kv_manager import KVCacheManager, held
from engine.sched.lora import lora_fits
from engine.sched.mirror import RunnerMirror
from engine.sched.preemption import SWAP, PreemptionCost, PreemptionStats
from engine.sched.request import Request, RequestStatus
from engine.sched.speculation import SpecConfig, SpecStats, Speculation
from engine.sched.stopping import Stopping
from engine.step_plan import (
    DraftProposals,
    PromptLogprobsSpan,
    RunnerOutput,
    Sampled,
    SampleRow,
    StepPlan,
    decode_first,
)
from ipc.messages import PositionLogprobs, TokenDelta


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    spec: SpecConfig | None = None
    vocab_size: int | None = None  # the logits' width: grammar masks need it
    max_loras: int | None = None  # distinct LoRA adapters running at once (None: LoRA off)
    # NOTE: the most tokens of one prompt a step takes while other requests decode (None: the
    # budget's): their next tokens wait for the whole step (ipc/config.py)
    max_prefill_tokens_while_decoding: int | None = None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        eos_token_ids: Sequence[int],
        preemption: PreemptionCost | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.stopping = Stopping(eos_token_ids, config.max_model_len)
        self.preemption = preemption or PreemptionCost(0, 0.0, "cpu", "recompute")
        self.speculation = Speculation(config.spec, config.max_model_len)
        self.grammars = Grammars(config.vocab_size or 0, config.max_model_len)
        self.running: list[Request] = []  # sorted by sort_key
        self.swapped: list[Request] = []  # sorted by sort_key; they return before admissions
        self._waiting: list[tuple[tuple, Request]] = []  # heap by sort_key
        self._compiling: list[Request] = []  # WAITING_FOR_GRAMMAR, in arrival order
        self.groups: dict[str, list[Request]] = {}  # request id -> its live choices
        self.beam_finished: dict[str, list[beams.Hypothesis]] = {}  # ended hypotheses
        self.preemptions = PreemptionStats()
        self._by_key: dict[str, Request] = {}  # every live choice by its key
        self._mirror = RunnerMirror(kv)
        self._step = 0
        self._chunk = config.max_num_batched_tokens  # this step's, set by schedule()

    # ---- queue ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._compiling)

    @property
    def num_preemptions(self) -> int:
        return self.preemptions.swap + self.preemptions.recompute

    @property
    def spec_stats(self) -> SpecStats:
        return self.speculation.stats

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def is_live(self, key: str) -> bool:
        """A choice with this key is queued or running (its key is taken)."""
        return key in self._by_key

    def add(self, request: Request) -> None:
        """Queue a request; its other choices (request.children) fork after its prompt."""
        self.groups[request.request_id] = [request, *request.children]
        ends = self.stopping.end_tokens(request.sampling)  # NOTE: once, for every choice
        for choice in self.groups[request.request_id]:
            choice.end_token_ids = ends
            self._by_key[choice.key] = choice
        if request.pending_grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._compiling.append(request)  # NOTE: the next step queues it (or ends it)
            return
        heapq.heappush(self._waiting, (request.sort_key, request))

    def admit_compiled(self) -> list[TokenDelta]:
        """Queue the requests whose grammar is ready; end those whose grammar failed."""
        deltas: list[TokenDelta] = []
        for req in list(self._compiling):
            assert req.pending_grammar is not None
            result = req.pending_grammar.poll()
            if result is None:
                continue
            self._compiling.remove(req)
            req.pending_grammar = None
            req.status = RequestStatus.WAITING
            choices = list(self.groups[req.request_id])
            if isinstance(result, Exception):
                for choice in choices:
                    choice.error, choice.error_param = str(result), result.param
                    self._finish(choice, RequestStatus.FINISHED_ERROR)
                    deltas.append(delta(choice, []))
                continue
            for choice in choices:  # n > 1: one matcher per choice, each from the start
                choice.grammar = result.matcher()
            heapq.heappush(self._waiting, (req.sort_key, req))
        return deltas

    def wait_for_grammar(self, timeout: float) -> None:
        """Nothing else to run: block up to `timeout` s on the oldest compiling grammar."""
        if self._compiling and not self.running and not self._waiting and not self.swapped:
            pending = self._compiling[0].pending_grammar
            assert pending is not None
            pending.wait(timeout)

    def abort(self, request_ids: Iterable[str], index: int | None = None) -> list[TokenDelta]:
        """Finish live requests (all their choices, or only choice `index`) as aborted, freeing
        their blocks now; unknown ids are ignored."""
        deltas = []
        for rid in request_ids:
            for req in list(self.groups.get(rid, ())):
                if index is None or req.index == index:
                    self._finish(req, RequestStatus.FINISHED_ABORTED)
                    deltas.append(delta(req, []))
        return deltas

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._step += 1
        plan = StepPlan(self._step)
        self._chunk = self._prefill_chunk()
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted_keys:
            budget = self._swap_in(plan, budget)
            if not self.swapped:
                self._admit_waiting(plan, budget)
        self._plan_rows(plan)
        plan.num_prompt_tokens = self._prompt_tokens_in(plan)
        plan.block_copies = self.kv.take_pending_copies()
        plan.finished_keys = self._mirror.take_finished()
        return plan

    def attach_drafts(self, plan: StepPlan, proposals: DraftProposals) -> None:
        """The second phase of a self-draft step: the runner's proposals become the plan's
        draft tokens (with their grammar masks), verified by the same plan's execute."""
        for key, drafts in proposals.token_ids.items():
            assert len(drafts) == plan.self_drafts[key], "the runner proposes gamma tokens"
            plan.spec_token_ids[key] = list(drafts)
        drafting = [self._by_key[r.key] for r in plan.sampling if r.key in plan.self_drafts]
        plan.grammar_masks.update(self.grammars.masks(drafting, plan.spec_token_ids))

    def _prompt_tokens_in(self, plan: StepPlan) -> int:
        """Prompt tokens the plan computes: of each key's scheduled tokens, those before the
        end of its prompt (its computed tokens are still the step's start)."""
        total = 0
        for key, n in plan.num_scheduled_tokens.items():
            req = self._by_key[key]
            total += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
        return total

    def _prefill_chunk(self) -> int:
        """The most tokens of one prompt this step: the cap while a running request decodes
        (it has one token left to compute, or none: a beam waiting for its siblings)."""
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is not None and any(r.num_tokens - r.num_computed_tokens <= 1
                                   for r in self.running):
            return cap
        return self.config.max_num_batched_tokens

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk)
            if n == 0:  # a beam waiting for its siblings to catch up
                i += 1
                continue
            if n == 1 and budget > 1 and req.num_tokens - req.num_computed_tokens == 1:
                n += self._plan_drafts(req, budget - 1, plan)
            if not self._allocate_or_preempt(req, n, plan):
                plan.self_drafts.pop(req.key, None)
                plan.spec_token_ids.pop(req.key, None)
                break  # req itself was preempted: it was the last one
            plan.num_scheduled_tokens[req.key] = n
            budget -= n
            i += 1
        return budget

    def _plan_drafts(self, req: Request, room: int, plan: StepPlan) -> int:
        """The speculation policy's drafts for a decoding choice, into the plan."""
        proposal = self.speculation.propose(req, room)
        if proposal is None:
            return 0
        if proposal.gamma:
            plan.self_drafts[req.key] = proposal.gamma
        else:
            plan.spec_token_ids[req.key] = list(proposal.tokens)
        return proposal.num_tokens

    def _allocate_or_preempt(self, req: Request, n: int, plan: StepPlan) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running[-1]  # lowest priority, newest
            self._preempt(victim)
            plan.preempted_keys.append(victim.key)
            if victim is req:
                return False
        return True

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if not lora_fits(req, self.running, self.config.max_loras):
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk)
            blocks = len(held(self.kv.cpu_block_ids(req.key)))
            if self.kv.blocks_to_swap_in(req, n) > self.kv.num_free_blocks:
                break
            # NOTE: explicit checks, not asserts: these calls do the work (`python -O`
            # strips asserts), and the room was checked just above.
            if not self.kv.swap_in(req) or not self.kv.allocate_slots(req, n):
                raise RuntimeError(f"swap-in of {req.request_id!r} found no room after the check")
            self.preemptions.swap_in_blocks += blocks
            self.swapped.pop(0)
            self._start(req, n, plan)
            budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self._waiting and budget > 0:
            req = self._waiting[0][1]
            width = 1 + len(req.children)  # forked choices will run too
            if len(self.running) + width > self.config.max_num_seqs and self.running:
                break
            if not lora_fits(req, self.running, self.config.max_loras):
                break  # NOTE: in order: it waits for a running adapter to finish
            # NOTE: prompt logprobs need every prompt position's logits: no cached prefix
            wants_prompt = req.prompt_logprobs is not None and not req.prompt_logprobs_sent
            # NOTE: and pooling needs every prompt position's hidden state (mean, cls)
            pools = req.sampling.pooling is not None
            cached = [] if wants_prompt or pools else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget, self._chunk)
            if not self.kv.allocate_slots(req, n, cached):
                break
            heapq.heappop(self._waiting)
            self.kv.record_prefix_query(req.num_tokens, num_cached)
            req.resume_from(num_cached)
            self._start(req, n, plan)
            budget -= n

    def _start(self, req: Request, n: int, plan: StepPlan) -> None:
        if req.scheduled_time is None:
            req.scheduled_time = time.time()
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)
        plan.num_scheduled_tokens[req.key] = n

    def _plan_rows(self, plan: StepPlan) -> None:
        """For each scheduled choice, in the runner's order (decodes first): its runner entry,
        its prompt-logprob span, and whether it samples (then its forked choices too: n > 1
        choices sample from its logits); then the grammar masks of those that sample."""
        masked: list[Request] = []
        for key in decode_first(plan):
            req = self._by_key[key]
            n = plan.num_scheduled_tokens[key]
            self._mirror.add_to(plan, req)
            if req.prompt_logprobs is not None:
                span = req.prompt_logprob_positions(req.num_computed_tokens, n)
                if span:
                    k = req.sampling.prompt_logprobs
                    assert k is not None
                    plan.prompt_logprobs[key] = PromptLogprobsSpan(span.start, span.stop, k)
            drafts = len(plan.spec_token_ids.get(key, ())) or plan.self_drafts.get(key, 0)
            if req.num_computed_tokens + n != req.num_tokens + drafts:
                continue  # a prefill chunk that does not reach the end yet
            if req.sampling.pooling is not None:
                continue  # NOTE: prefill only: the runner pools it, nothing is sampled
            plan.sampling.append(SampleRow(key, key))
            for child in req.children:
                plan.sampling.append(SampleRow(child.key, key))
                self._mirror.add_to(plan, child)
            if req.grammar is not None and key not in plan.self_drafts:
                masked += [req, *req.children]
        if masked:
            plan.grammar_masks.update(self.grammars.masks(masked, plan.spec_token_ids))

    # ---- update ----------------------------------------------------------------------------

    def update(self, plan: StepPlan, output: RunnerOutput | None) -> list[TokenDelta]:
        """Advance progress and cache full blocks; then take the runner's output: prompt
        logprobs, forks, each sampled row's tokens (finishing what stopped), beam steps."""
        scheduled = [self._by_key[key] for key in plan.num_scheduled_tokens]
        for req, n in zip(scheduled, plan.num_scheduled_tokens.values(), strict=True):
            req.num_computed_tokens += n
        if output is not None:
            self._settle_speculation(plan, output)
        for req in scheduled:
            self.kv.cache_full_blocks(req)
        if output is None:
            return []
        for key, positions in output.prompt_logprobs.items():
            self._by_key[key].prompt_logprobs.extend(positions)  # type: ignore[union-attr]
        pooled = self._finish_pooled(output.pooled)
        rows = [(self._by_key[r.key], self._by_key[r.logits_key]) for r in plan.sampling]
        for req, parent in rows:
            if req is not parent:  # fork every choice before any of them may finish
                self._fork(parent, req)
        deltas: list[TokenDelta] = []
        beam_groups: set[str] = set()
        for req, _ in rows:
            req.children = []
            sampled = output.sampled[req.key]
            if req.sampling.use_beam_search and not sampled.accepted:
                assert sampled.logprobs is not None
                req.beam_candidates = [(t.token_id, t.logprob) for t in sampled.logprobs.top]
                beam_groups.add(req.request_id)
            elif (found := self._take_sampled(req, sampled)) is not None:
                deltas.append(found)
        for rid in beam_groups:
            deltas += self._beam_step(rid)
        return pooled + deltas

    def _finish_pooled(self, vectors: dict[str, list[float]]) -> list[TokenDelta]:
        """Pooling requests whose prompt was computed end with their vector; their blocks
        are freed now (a pooling request holds KV only while its prompt is computed)."""
        deltas = []
        for key, vector in vectors.items():
            req = self._by_key[key]
            req.pooled = vector
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            deltas.append(delta(req, []))
        return deltas

    def _take_sampled(self, req: Request, sampled: Sampled) -> TokenDelta | None:
        """A row's accepted drafts and sampled token, appended (None: the token was refused)."""
        if sampled.accepted:
            return self._append(req, [*sampled.accepted, sampled.token_id])
        token, logprobs = sampled.token_id, sampled.logprobs
        if self.grammars.refuses(req, token):
            # NOTE: the refused token's K/V is not written yet (the next step would write
            # it), so the choice steps back one computed position: its last token's K/V is
            # written again, with the values it has; the next mask forces the closing
            req.num_computed_tokens -= 1
            return None
        if logprobs is not None:
            req.cumulative_logprob += logprobs.logprob
        return self._append(req, [token], None if req.sampling.logprobs is None else [logprobs])

    def _append(self, req: Request, tokens: list[int],
                logprobs: list[PositionLogprobs | None] | None = None) -> TokenDelta:
        """Append tokens (one sampled, or accepted drafts and the one after them), stopping
        where a stop rule says; their delta."""
        kept: list[int] = []
        for token in tokens:
            req.append_token(token)
            kept.append(token)
            stop = self.stopping.check(req, token)
            if stop is not None:
                self._finish(req, stop.status, stop.stop_reason)
                break
        return delta(req, kept, logprobs)

    def _settle_speculation(self, plan: StepPlan, output: RunnerOutput) -> None:
        """Apply verification: roll back the KV of rejected drafts and count them."""
        if not plan.spec_token_ids:
            return
        for row in plan.sampling:
            drafts = plan.spec_token_ids.get(row.key)
            if not drafts:
                continue
            req, accepted = self._by_key[row.key], len(output.sampled[row.key].accepted)
            # NOTE: their K/V slots were written; dropping them from the computed count
            # means the next step overwrites them, and trim() gives back emptied blocks.
            req.num_computed_tokens -= self.speculation.settle(req.key, len(drafts), accepted)
            req.num_spec_draft_tokens += len(drafts)
            req.num_spec_accepted_tokens += accepted
            self.kv.trim(req)

    # ---- beam search -----------------------------------------------------------------------

    def _beam_step(self, rid: str) -> list[TokenDelta]:
        """Apply the beam module's decisions for the group (beams.plan_step)."""
        group = self.groups[rid]
        s = group[0].sampling
        step = beams.plan_step([_member(r) for r in group], s.n, group[0].end_token_ids,
                               s.min_tokens)
        if step is None:
            return []
        self.beam_finished.setdefault(rid, []).extend(step.ended)
        for i in step.park:
            self._park(group[i])
        for spare, parent in step.forks:
            group[spare].become_copy_of(group[parent])
            self._mirror.rewrite_tokens(group[spare], group[spare].num_prompt_tokens)
            self._fork(group[parent], group[spare])
        for i, token, score in step.append:
            group[i].append_token(token)
            group[i].cumulative_logprob = score
        live = [group[i] for i, _, _ in step.append]
        for r in group:
            r.beam_candidates = None
        return self._beam_finish_if_done(rid, live)

    def _beam_finish_if_done(self, rid: str, live: list[Request]) -> list[TokenDelta]:
        group = self.groups[rid]
        s = group[0].sampling
        at_limit = bool(live) and (
            max(r.num_output_tokens for r in live) >= max(r.max_tokens for r in live)
            or max(r.num_tokens for r in live) >= self.config.max_model_len)
        top = beams.final(self.beam_finished[rid], [_member(r) for r in live], s.n,
                          s.length_penalty, at_limit)
        if top is None:
            return []
        members = list(group)
        for r in members:
            self._finish(r, RequestStatus.FINISHED_STOPPED)  # the last one drops the group
        return beam_deltas(rid, top, members)

    # ---- verbs -----------------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        blocks = len(held(self.kv.block_ids(req.key)))
        choice = self.preemption.choose(blocks, req.num_computed_tokens,
                                        self.kv.can_swap_out(req))
        if choice == SWAP:
            self.preemptions.swap += 1
            self.preemptions.swap_out_blocks += blocks
            self.kv.swap_out(req)
            bisect.insort(self.swapped, req, key=lambda r: r.sort_key)
            return
        # NOTE: recompute: the request's tokens so far (prompt + output) are computed again
        # when it is readmitted; its output is kept, so nothing is lost or repeated.
        self.preemptions.recompute += 1
        self.kv.free(req)
        req.num_lost_tokens = req.num_computed_tokens
        req.num_computed_tokens = 0
        heapq.heappush(self._waiting, (req.sort_key, req))

    def _park(self, req: Request) -> None:
        """A beam with no continuation keeps its place (index) in the group but no blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING

    def _fork(self, parent: Request, child: Request) -> None:
        self.kv.fork(parent, child)
        child.follow(parent)
        child.status = RequestStatus.RUNNING
        bisect.insort(self.running, child, key=lambda r: r.sort_key)

    def _finish(self, req: Request, status: RequestStatus,
                stop_reason: int | None = None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self._compiling.remove(req)
        elif self.kv.is_swapped(req.key):
            self.swapped.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and any(
            r is req for _, r in self._waiting
        ):
            self._waiting.remove((req.sort_key, req))
            heapq.heapify(self._waiting)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        req.finished_time = time.time()
        self.kv.free(req)
        self._mirror.finished(req.key)
        self.speculation.forget(req.key)
        del self._by_key[req.key]
        group = self.groups[req.request_id]
        group.remove(req)
        if not group:
            del self.groups[req.request_id]
            self.beam_finished.pop(req.request_id, None)


def _member(r: Request) -> beams.Member:
    return beams.Member(r.output_token_ids, r.cumulative_logprob, r.beam_candidates,
                        r.status == RequestStatus.RUNNING)
