"""The Scheduler driven step by step with a fake runner and a real KV manager: scheduled token
counts, chunked-prefill splits, admission into a running batch, preemption victims and mode,
swap-in order, exact block ids, and exactly one terminal delta per request."""

from __future__ import annotations

import random

import msgspec
import pytest

from engine.run.rows import RowStates
from engine.sched.kv_manager import NULL_BLOCK, KVCacheManager
from engine.sched.preemption import PreemptionCost
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig, SpecConfig
from engine.step_plan import (
    BlockCopy,
    CopyKind,
    Diff,
    DraftProposals,
    RunnerOutput,
    Sampled,
    StepPlan,
    decode_first,
)
from ipc.messages import TokenDelta
from ipc.sampling import SamplingParams

EOS = 0
TOKEN = 7  # what the fake runner samples unless told otherwise


def make(num_blocks: int, budget: int, *, mode: str = "swap", cpu_blocks: int = 8,
         max_num_seqs: int = 4, prefix_caching: bool = False,
         max_prefill_tokens_while_decoding: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, prefix_caching, cpu_blocks)
    config = SchedulerConfig(max_num_seqs, budget, 64,
                             max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding)
    return Scheduler(config, kv, [EOS], PreemptionCost(1, 1.0, "cpu", mode))


def request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt, params, max_tokens, priority=priority)


class FakeRunner:
    """Samples TOKEN (or what `script` says for a request id) for every sampling request.

    It keeps the real runner's row state (RowStates) from each plan, and checks that what the
    plan's entries built equals the scheduler's requests and the KV manager's tables."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}
        self.states = RowStates(max_blocks_per_seq=16, device=None)  # type: ignore[arg-type]

    def check_mirror(self, s: Scheduler, plan: StepPlan) -> None:
        self.states.apply(plan)
        assert set(plan.finished_keys).isdisjoint(self.states.rows)
        # NOTE: every row the plan computes or samples (a prefill chunk that samples nothing
        # has diffs too)
        for key in dict.fromkeys([*plan.num_scheduled_tokens, *(r.key for r in plan.sampling)]):
            state, req = self.states.rows[key], s._by_key[key]
            assert state.token_ids == req.all_token_ids
            table = [max(b, 0) for b in s.kv.block_ids(key)]
            assert state.num_blocks == len(table)
            assert self.states.block_table[state.slot, : len(table)].tolist() == table
            assert not self.states.block_table[state.slot, len(table):].any()
            assert state.num_computed_tokens == req.num_computed_tokens

    def step(self, s: Scheduler):
        out = s.schedule()
        self.check_mirror(s, out)
        sampled = {r.key: Sampled(self.script[r.key].pop(0) if self.script.get(r.key) else TOKEN,
                                  [], None) for r in out.sampling}
        return out, s.update(out, RunnerOutput(sampled))


def counts(out) -> list[tuple[str, int]]:
    """(key, tokens) in the runner's batch order (decodes first)."""
    return [(key, out.num_scheduled_tokens[key]) for key in decode_first(out)]


def gpu_to_cpu(src: int, dst: int) -> BlockCopy:
    return BlockCopy(CopyKind.GPU_TO_CPU, src, dst)


def cpu_to_gpu(src: int, dst: int) -> BlockCopy:
    return BlockCopy(CopyKind.CPU_TO_GPU, src, dst)


def test_chunked_prefill_splits_then_decodes_with_exact_blocks():
    s, run = make(num_blocks=6, budget=4), FakeRunner()
    a = request("a", 10, max_tokens=3)
    s.add(a)
    plan = []
    for _ in range(5):
        out, deltas = run.step(s)
        plan.append((counts(out), s.kv.block_ids("a"), [d.finish_reason for d in deltas]))
    assert plan == [
        ([("a", 4)], [0], []),  # prompt chunk 1 of 3: nothing sampled
        ([("a", 4)], [0, 1], []),
        ([("a", 2)], [0, 1, 2], [None]),  # the chunk that completes the prompt samples
        ([("a", 1)], [0, 1, 2], [None]),  # the 11th slot: still 3 blocks
        ([("a", 1)], [], ["length"]),  # the 12th: 3 blocks, then the third token ends it
    ]
    assert a.output_token_ids == [TOKEN] * 3
    # freed tail first, behind the blocks never used: the eviction order
    assert s.kv.pool.free_ids() == [3, 4, 5, 2, 1, 0]
    assert not s.has_unfinished()


def test_a_request_arriving_mid_generation_joins_the_next_step_behind_the_decodes():
    s, run = make(num_blocks=8, budget=8), FakeRunner()
    s.add(request("a", 4, max_tokens=5))
    assert counts(run.step(s)[0]) == [("a", 4)]
    assert counts(run.step(s)[0]) == [("a", 1)]
    s.add(request("b", 6, max_tokens=2))
    out, deltas = run.step(s)
    assert counts(out) == [("a", 1), ("b", 6)]  # one-token queries first
    assert [d.request_id for d in deltas] == ["a", "b"]
    assert counts(run.step(s)[0]) == [("a", 1), ("b", 1)]


def test_the_budget_caps_a_step_and_the_rest_waits():
    s, run = make(num_blocks=16, budget=8), FakeRunner()
    for rid in "abc":
        s.add(request(rid, 5, max_tokens=4))
    assert counts(run.step(s)[0]) == [("a", 5), ("b", 3)]  # b's prompt is split
    assert counts(run.step(s)[0]) == [("a", 1), ("b", 2), ("c", 5)]


def test_the_plan_counts_the_prompt_tokens_it_computes():
    """StepPlan.num_prompt_tokens: of each key's scheduled tokens, those of its prompt (the
    engine's prompt-token count); decode tokens, and the output a recompute computes again,
    are not."""
    s, run = make(num_blocks=16, budget=8), FakeRunner()
    for rid in "abc":
        s.add(request(rid, 5, max_tokens=4))
    assert run.step(s)[0].num_prompt_tokens == 5 + 3  # a's prompt, b's first chunk
    assert run.step(s)[0].num_prompt_tokens == 2 + 5  # a decodes; b's rest, c's prompt
    assert run.step(s)[0].num_prompt_tokens == 0
    s, run = make(num_blocks=4, budget=16, mode="recompute"), FakeRunner()
    s.add(request("a", 8, max_tokens=3))
    s.add(request("b", 7, max_tokens=3))
    run.step(s)
    assert run.step(s)[0].preempted_keys == ["b"]
    run.step(s)  # a finishes
    out, _ = run.step(s)
    assert counts(out) == [("b", 8)] and out.num_prompt_tokens == 7


def test_a_long_prompt_takes_small_chunks_only_while_others_decode():
    """max_prefill_tokens_while_decoding caps each prompt's chunk in the steps where another request
    decodes (whose next token waits for the step); alone, a prompt takes the whole budget."""
    s, run = make(num_blocks=32, budget=16, max_prefill_tokens_while_decoding=3), FakeRunner()
    s.add(request("long", 20, max_tokens=1))
    assert counts(run.step(s)[0]) == [("long", 16)]  # nothing decodes: the budget
    run.step(s)
    s.add(request("a", 2, max_tokens=4))
    assert counts(run.step(s)[0]) == [("a", 2)]
    s.add(request("b", 9, max_tokens=1))
    s.add(request("c", 2, max_tokens=1))
    steps = [counts(run.step(s)[0]) for _ in range(4)]
    assert steps == [
        [("a", 1), ("b", 3), ("c", 2)],  # each prompt capped at 3 while a decodes
        [("a", 1), ("b", 3)],  # c's whole prompt ran: it sampled its one token and ended
        [("a", 1), ("b", 3)],  # b's last chunk: it samples and ends; a finishes too
        [],
    ]
    assert not s.has_unfinished()


def test_max_num_seqs_holds_admission():
    s, run = make(num_blocks=16, budget=64, max_num_seqs=2), FakeRunner()
    for rid in "abc":
        s.add(request(rid, 4, max_tokens=2))
    assert counts(run.step(s)[0]) == [("a", 4), ("b", 4)]
    assert s.num_waiting == 1
    assert counts(run.step(s)[0]) == [("a", 1), ("b", 1)]  # both finish here
    assert counts(run.step(s)[0]) == [("c", 4)]


def test_swap_preempts_the_newest_and_resumes_it_before_new_admissions():
    s, run = make(num_blocks=4, budget=16, mode="swap"), FakeRunner()
    a, b = request("a", 8, max_tokens=3), request("b", 7, max_tokens=3)
    s.add(a)
    s.add(b)
    out, _ = run.step(s)
    assert counts(out) == [("a", 8), ("b", 7)]
    assert (s.kv.block_ids("a"), s.kv.block_ids("b")) == ([0, 1], [2, 3])
    # a's 9th token needs a third block: the newest request, b, is swapped out to make room
    out, _ = run.step(s)
    assert counts(out) == [("a", 1)] and out.preempted_keys == ["b"]
    assert out.block_copies == [gpu_to_cpu(2, 0), gpu_to_cpu(3, 1)]
    tables = s.kv.block_ids("a"), s.kv.cpu_block_ids("b"), s.kv.block_ids("b")
    assert tables == ([0, 1, 3], [0, 1], [])
    assert s.preemptions.swap == 1 and s.preemptions.recompute == 0
    c = request("c", 4, max_tokens=2)
    s.add(c)
    out, deltas = run.step(s)  # a ends; one block is free, but c waits behind swapped b
    assert counts(out) == [("a", 1)] and deltas[0].finish_reason == "length"
    assert s.kv.pool.free_ids() == [2, 3, 1, 0]
    out, _ = run.step(s)
    assert counts(out) == [("b", 1), ("c", 4)]  # b first, then c is admitted
    assert out.block_copies == [cpu_to_gpu(0, 2), cpu_to_gpu(1, 3)]
    tables = s.kv.block_ids("b"), s.kv.cpu_block_ids("b"), s.kv.block_ids("c")
    assert tables == ([2, 3], [], [1])


def test_recompute_preemption_recomputes_prompt_and_output():
    s, run = make(num_blocks=4, budget=16, mode="recompute"), FakeRunner()
    a, b = request("a", 8, max_tokens=3), request("b", 7, max_tokens=3)
    s.add(a)
    s.add(b)
    run.step(s)
    out, _ = run.step(s)
    assert out.preempted_keys == ["b"] and out.block_copies == []
    assert b.num_computed_tokens == 0 and s.kv.block_ids("b") == [] and s.num_waiting == 1
    assert s.preemptions.recompute == 1 and s.preemptions.swap == 0
    run.step(s)  # a finishes
    out, deltas = run.step(s)
    assert counts(out) == [("b", 8)]  # its 7 prompt tokens and its first output token
    assert b.output_token_ids == [TOKEN, TOKEN] and deltas[0].new_token_ids == [TOKEN]
    assert b.num_recomputed_tokens == 7


def test_priority_picks_the_victim_and_the_admission_order():
    s, run = make(num_blocks=4, budget=16, mode="swap"), FakeRunner()
    low, high = request("low", 8, max_tokens=3, priority=5), request("high", 7, 3, priority=0)
    s.add(low)
    s.add(high)
    out, _ = run.step(s)
    assert counts(out) == [("high", 7), ("low", 8)]  # lower value first
    out, _ = run.step(s)
    # low needs a third block for its 9th token: it is itself the lowest priority
    assert out.preempted_keys == ["low"] and counts(out) == [("high", 1)]


def test_eos_and_stop_token_ids_finish_and_min_tokens_holds_them():
    s = make(num_blocks=8, budget=16)
    run = FakeRunner({"a": [TOKEN, EOS], "b": [EOS, EOS, 5]})
    s.add(request("a", 4, max_tokens=8))
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(5,))
    s.add(Request("b", [1, 2, 3], params, 8))
    ends = {}
    for _ in range(4):
        for d in run.step(s)[1]:
            if d.finish_reason:
                ends[d.request_id] = (d.finish_reason, d.stop_reason)
    assert ends == {"a": ("stop", None), "b": ("stop", 5)}


def _drive(seed: int, mode: str) -> tuple[Scheduler, dict[tuple[str, int], list[TokenDelta]]]:
    rng = random.Random(seed)
    s = make(num_blocks=10, budget=12, mode=mode, cpu_blocks=6, max_num_seqs=5)
    script: dict[str, list[int]] = {}
    run = FakeRunner(script)
    terminal: dict[tuple[str, int], list[TokenDelta]] = {}
    added = []
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            rid = f"r{len(added)}"
            script[rid] = [rng.choice([TOKEN, TOKEN, TOKEN, EOS]) for _ in range(12)]
            s.add(request(rid, rng.randint(1, 20), rng.randint(1, 12),
                          priority=rng.randint(0, 2)))
            added.append(rid)
        deltas = []
        if added and rng.random() < 0.05:
            deltas += s.abort([rng.choice(added)])
        deltas += run.step(s)[1]
        for d in deltas:
            if d.finish_reason is not None:
                terminal.setdefault((d.request_id, d.index), []).append(d)
        if step > 60 and not s.has_unfinished():
            break
    assert not s.has_unfinished(), "the workload did not drain"
    return s, {(rid, 0): terminal.get((rid, 0), []) for rid in added}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("seed", range(6))
def test_every_request_ends_with_exactly_one_terminal_delta_and_blocks_balance(seed, mode):
    s, terminal = _drive(seed, mode)
    assert all(len(ds) == 1 for ds in terminal.values()), {
        k: [d.finish_reason for d in ds] for k, ds in terminal.items() if len(ds) != 1}
    assert s.kv.num_free_blocks == 10 and s.kv.num_free_cpu_blocks == 6
    assert s.num_preemptions > 0  # the small pool makes every seed preempt
    if mode == "recompute":
        assert s.preemptions.swap == 0


def test_abort_is_idempotent_and_frees_blocks_now():
    s, run = make(num_blocks=8, budget=16), FakeRunner()
    a = request("a", 6, max_tokens=8)
    s.add(a)
    run.step(s)
    assert s.kv.block_ids("a") == [0, 1]
    (delta,) = s.abort(["a"])
    assert delta.finish_reason == "abort" and s.kv.num_free_blocks == 8
    assert s.abort(["a"]) == [] and s.abort(["unknown"]) == []
    assert s.schedule().empty


def test_a_choice_is_sent_in_full_once_then_as_diffs_with_exact_block_ids():
    s, run = make(num_blocks=6, budget=4), FakeRunner()
    s.add(request("a", 10, max_tokens=3))
    plans = [run.step(s)[0] for _ in range(5)]
    (new,) = plans[0].new_requests
    assert (new.key, new.token_ids, new.block_ids, new.num_computed_tokens) == (
        "a", [100 + i for i in range(10)], [0], 0)
    assert plans[0].cached_requests == []
    diffs = [[(c.tokens, c.block_ids, c.num_computed_tokens) for c in p.cached_requests]
             for p in plans[1:]]
    assert diffs == [
        [(None, Diff(1, [1]), 4)],  # the second prompt chunk's block is appended
        [(None, Diff(2, [2]), 8)],
        [(Diff(10, [TOKEN]), None, 10)],  # the sampled token; the block has room
        [(Diff(11, [TOKEN]), None, 11)],
    ]
    assert all(p.new_requests == [] and p.finished_keys == [] for p in plans[1:])
    final = s.schedule()
    assert final.empty and final.finished_keys == ["a"]  # the runner drops its row


def test_copy_on_write_after_a_fork_rewrites_the_writers_table_entry():
    s, run = make(num_blocks=8, budget=16), FakeRunner()
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2)
    a = Request("a", [1, 2, 3, 4, 5, 6], params, 3)
    a.children = [Request("a", [1, 2, 3, 4, 5, 6], params, 3, index=1)]
    s.add(a)
    first, _ = run.step(s)
    assert [(r.key, r.logits_key) for r in first.sampling] == [("a", "a"), ("1_a", "a")]
    assert [(n.key, n.block_ids) for n in first.new_requests] == [("a", [0, 1]), ("1_a", [])]
    second, _ = run.step(s)  # both write position 6 in block 1, which they share
    assert second.block_copies == [BlockCopy(CopyKind.GPU_TO_GPU, 1, 2)]
    tables = {c.key: c.block_ids for c in second.cached_requests}
    assert tables == {"a": Diff(1, [2]), "1_a": Diff(0, [0, 1])}
    assert (s.kv.block_ids("a"), s.kv.block_ids("1_a")) == ([0, 2], [0, 1])


def test_self_draft_proposals_come_from_the_runner_in_the_first_phase():
    kv = KVCacheManager(16, 4, False, 0)
    s = Scheduler(SchedulerConfig(4, 16, 64, SpecConfig("self", 2)), kv, [EOS])
    a = request("a", 4, max_tokens=8)
    s.add(a)
    first = s.schedule()
    assert first.self_drafts == {}  # a prompt step does not draft
    s.update(first, RunnerOutput({"a": Sampled(TOKEN, [], None)}))
    plan = s.schedule()
    # gamma 2: three slots (the newest token and two drafts), and no placeholder drafts
    assert plan.self_drafts == {"a": 2} and plan.num_scheduled_tokens == {"a": 3}
    assert plan.spec_token_ids == {}  # NOTE: the plan is the drafts' one record (no Request copy)
    assert kv.block_ids("a") == [0, 1]
    s.attach_drafts(plan, DraftProposals({"a": [8, 9]}))
    assert plan.spec_token_ids == {"a": [8, 9]}
    (delta,) = s.update(plan, RunnerOutput({"a": Sampled(5, [8], None)}))  # 9 is rejected
    assert delta.new_token_ids == [8, 5] and a.output_token_ids == [TOKEN, 8, 5]
    assert a.num_computed_tokens == 6  # the rejected draft's slot is given back
    assert s.spec_stats.draft_tokens == 2 and s.spec_stats.accepted_tokens == 1


def test_ngram_drafts_are_in_the_plan_when_scheduled():
    kv = KVCacheManager(16, 4, False, 0)
    s = Scheduler(SchedulerConfig(4, 16, 64, SpecConfig("ngram", 3)), kv, [EOS])
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=8), 8)
    s.add(a)
    s.update(s.schedule(), RunnerOutput({"a": Sampled(3, [], None)}))
    plan = s.schedule()  # 1 2 3 1 2 3: the first "1 2 3" was followed by "1 2 3"
    assert plan.spec_token_ids == {"a": [1, 2, 3]} and plan.num_scheduled_tokens == {"a": 4}
    assert plan.self_drafts == {}


def test_the_plan_and_the_runner_output_are_plain_msgpack_data():
    s, run = make(num_blocks=4, budget=16, mode="swap"), FakeRunner()
    s.add(request("a", 8, max_tokens=3))
    s.add(request("b", 7, max_tokens=3))
    run.step(s)
    plan = s.schedule()  # b is swapped out: typed block copies
    assert plan.block_copies and plan.preempted_keys == ["b"]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
    assert decoded == plan and isinstance(decoded.block_copies[0].kind, CopyKind)
    out = RunnerOutput({"a": Sampled(TOKEN, [3], None)})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=RunnerOutput) == out


def test_n_choices_fork_and_each_ends_once():
    s, run = make(num_blocks=12, budget=16), FakeRunner({"1_a": [TOKEN, EOS]})
    params = SamplingParams(temperature=0.0, max_tokens=4, n=3)
    a = Request("a", [1, 2, 3, 4, 5], params, 4)
    a.children = [Request("a", [1, 2, 3, 4, 5], params, 4, index=i) for i in (1, 2)]
    s.add(a)
    ends: dict[int, list[str]] = {}
    for _ in range(6):
        for d in run.step(s)[1]:
            if d.finish_reason:
                ends.setdefault(d.index, []).append(d.finish_reason)
    assert ends == {0: ["length"], 1: ["stop"], 2: ["length"]}
    assert s.kv.num_free_blocks == 12 and not s.has_unfinished()


def test_runner_rows_mirror_window_releases_as_block_zero():
    states = RowStates(max_blocks_per_seq=8, device=None)  # type: ignore[arg-type]
    kv = KVCacheManager(10, 4, False, 0, window=6)
    s = Scheduler(SchedulerConfig(4, 8, 64), kv, [EOS])
    a = request("a", 8, max_tokens=20)
    s.add(a)
    for _ in range(8):
        plan = s.schedule()
        states.apply(plan)
        row = states.rows["a"]
        table = kv.block_ids("a")
        assert states.block_table[row.slot, : len(table)].tolist() == [max(b, 0) for b in table]
        s.update(plan, RunnerOutput({r.key: Sampled(TOKEN, [], None) for r in plan.sampling}))
    assert kv.block_ids("a")[0] == NULL_BLOCK  # the window released the first block


# (params, end tokens, the token sampled under min_tokens): tokens 0 (EOS), 3 and 5 tie as the
# likeliest (greedy takes the lowest allowed id), 6 comes next
@pytest.mark.parametrize(("params", "ends", "sampled"), [
    (SamplingParams(), [EOS], 3),
    (SamplingParams(stop_token_ids=(5, 3)), [EOS, 3, 5], 6),
    (SamplingParams(stop_token_ids=(5,), ignore_eos=True), [5], EOS),
    (SamplingParams(ignore_eos=True), [], EOS),
])
def test_the_plan_carries_the_end_tokens_the_sampler_bans_before_min_tokens(params, ends,
                                                                            sampled):
    import torch

    from engine.run.sampler import Sampler

    s = make(num_blocks=8, budget=16)
    params = msgspec.structs.replace(params, temperature=0.0, min_tokens=2)
    s.add(Request("a", [1, 2, 3], params, 4))
    (new,) = s.schedule().new_requests
    assert new.end_token_ids == ends  # by hand: EOS unless ignore_eos, and stop_token_ids
    # the runner's row samples under min_tokens: every end token is banned, the others not
    row = RowStates(max_blocks_per_seq=4, device=torch.device("cpu"))
    row.apply(StepPlan(1, new_requests=[new]))
    logits = torch.zeros(1, 8)
    logits[0, [EOS, 3, 5]] = 10.0  # the end candidates are the likeliest
    logits[0, 6] = 5.0
    assert Sampler(0, torch.device("cpu"))(logits, [row.rows["a"]]).token_ids == [sampled]


def test_speculation_state_is_dropped_with_the_choice():
    kv = KVCacheManager(16, 4, False, 0)
    s = Scheduler(SchedulerConfig(4, 16, 64, SpecConfig("ngram", 3)), kv, [EOS])
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=6), 6)
    s.add(a)
    run = FakeRunner({"a": [3, 1, 2, 3, 1, 2]})
    while s.has_unfinished():
        run.step(s)
    assert s.spec_stats.verify_steps > 0 and not s.speculation._gamma
