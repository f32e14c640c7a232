"""The Scheduler driven step by step with a fake runner and a real KV manager: scheduled token
counts, chunked-prefill splits, admission into a running batch, preemption victims and mode,
swap-in order, exact block ids, and exactly one terminal delta per request."""

from __future__ import annotations

import random

import pytest

from engine.kv_manager import KVCacheManager
from engine.preemption import PreemptionCost
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_plan import BlockCopy, CopyKind, RunnerOutput, Sampled, decode_first
from ipc.messages import TokenDelta
from ipc.sampling import SamplingParams

EOS = 0
TOKEN = 7  # what the fake runner samples unless told otherwise


def make(num_blocks: int, budget: int, *, mode: str = "swap", cpu_blocks: int = 8,
         max_num_seqs: int = 4, prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, prefix_caching, cpu_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 64), kv, [EOS],
                     PreemptionCost(1, 1.0, "cpu", mode))


def request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt, params, max_tokens, priority=priority)


class FakeRunner:
    """Samples TOKEN (or what `script` says for a request id) for every sampling request."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}

    def step(self, s: Scheduler):
        out = s.schedule()
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
