"""EngineCore on a tiny random Llama: block accounting, aborts, preemption, priority, and
greedy parity with HF transformers on the same weights (the safetensors path, GQA)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from core_protocol import core_protocol_gaps

from engine.core import EngineCore
from engine.step_plan import RunnerOutput, StepPlan
from ipc.config import EngineConfig
from ipc.messages import AddRequest
from ipc.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def make_core(tiny_model_dir):
    def make(**options) -> EngineCore:
        return EngineCore(EngineConfig(model=str(tiny_model_dir), **options))

    return make


def test_engine_core_has_every_member_of_the_core_protocol(make_core):
    core = make_core(max_num_seqs=3, max_logprobs=4, swap_space=0.001)
    assert core_protocol_gaps(core) == []
    assert (core.max_num_seqs, core.max_logprobs) == (3, 4) and core.num_cpu_blocks > 0


def add(core, rid, prompt, params=GREEDY, priority=0):
    core.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, sampling=params,
                                priority=priority))


def run_to_end(core, max_steps=500):
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for d in core.step():
            assert d.request_id not in finish, "a delta after the terminal one"
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                finish[d.request_id] = d.finish_reason
    assert not core.has_unfinished_requests()
    return outputs, finish


def prompt(n, offset=0):
    return [(7 * i + offset) % 40000 + 100 for i in range(n)]


def test_block_counts_while_running_and_all_free_after(make_core):
    core = make_core(num_gpu_blocks=64, block_size=16)
    add(core, "a", prompt(500 - 12, 1), SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))
    add(core, "b", prompt(20, 2))
    core.step()  # both prompts fit the 2048-token budget: one step computes them
    a, b = core.scheduler.groups["a"][0], core.scheduler.groups["b"][0]
    assert len(core.kv.block_ids(a.key)) == -(-488 // 16) == 31
    assert len(core.kv.block_ids(b.key)) == 2
    _, finish = run_to_end(core)
    assert finish == {"a": "length", "b": "length"}
    assert a.num_tokens == 500 and core.kv.block_ids(a.key) == []
    assert core.kv.num_free_blocks == 64


def test_abort_frees_blocks_and_is_idempotent(make_core):
    core = make_core(num_gpu_blocks=32)
    add(core, "a", prompt(40), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    add(core, "w", prompt(10))
    core.step()
    assert core.kv.num_free_blocks < 32
    deltas = core.abort_requests(["a", "w", "missing"])
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "abort"), ("w", "abort")]
    assert core.abort_requests(["a"]) == []
    assert core.kv.num_free_blocks == 32
    assert not core.has_unfinished_requests()


def test_preemption_loses_no_output(make_core):
    prompts = [prompt(30, i) for i in range(4)]
    roomy = make_core(num_gpu_blocks=200, block_size=4)
    tight = make_core(num_gpu_blocks=24, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for core in (roomy, tight):
        for i, p in enumerate(prompts):
            add(core, str(i), p, params)
        results.append(run_to_end(core)[0])
    assert tight.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0
    assert results[0] == results[1]
    assert all(len(v) == 40 for v in results[1].values())
    assert tight.kv.num_free_blocks == 24


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_seeded_sampling_is_the_same_under_preemption(make_core, mode):
    """The runner keeps a choice's seeded generator in its row across preemption."""
    prompts = [prompt(30, i) for i in range(4)]
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=40, ignore_eos=True)
    results = []
    for blocks in (200, 24):
        core = make_core(num_gpu_blocks=blocks, block_size=4, preemption_mode=mode,
                         swap_space=0.01)
        for i, p in enumerate(prompts):
            add(core, str(i), p, params)
        results.append(run_to_end(core)[0])
        assert (core.scheduler.num_preemptions > 0) == (blocks == 24)
        assert core.step() == [] and core.runner.states.rows == {}  # the next plan drops them
    assert results[0] == results[1]


def test_the_runner_takes_and_returns_plain_data_keyed_by_choice(make_core):
    """Every plan and runner output of a mixed workload (n > 1, logprobs, prompt logprobs)
    survives a msgpack round trip; the runner answers exactly the plan's sampling keys."""
    core = make_core(max_logprobs=5)
    seen: list[tuple[StepPlan, RunnerOutput]] = []
    execute = core.runner.execute

    def recording(plan):
        output = execute(plan)
        seen.append((plan, output))
        return output

    core.runner.execute = recording
    add(core, "a", prompt(9), SamplingParams(n=2, seed=3, max_tokens=4, logprobs=2))
    add(core, "b", prompt(12, 1), SamplingParams(temperature=0, max_tokens=3,
                                                 prompt_logprobs=1))
    ends = []
    while core.has_unfinished_requests():
        ends += [(d.request_id, d.index) for d in core.step() if d.finished]
    assert sorted(ends) == [("a", 0), ("a", 1), ("b", 0)]  # one terminal delta each
    for plan, output in seen:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan) == plan
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=RunnerOutput)
        assert again == output
        assert list(output.sampled) == [r.key for r in plan.sampling]
    keys = {r.key for plan, _ in seen for r in plan.sampling}
    assert keys == {"a", "1_a", "b"}
    prompt_logprobs = [lp for _, out in seen for lp in out.prompt_logprobs.get("b", [])]
    assert len(prompt_logprobs) == 11  # prompt tokens 1 .. 11


def test_terminal_deltas_carry_the_request_timeline(make_core):
    core = make_core(num_gpu_blocks=24, block_size=4, preemption_mode="recompute")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        add(core, str(i), prompt(30, i), params)
    add(core, "never", prompt(8), params, priority=9)  # aborted before it is scheduled
    core.step()
    [gone] = core.abort_requests(["never"])
    assert gone.metrics.scheduled_time is None and gone.metrics.first_token_time is None
    metrics = {}
    while core.has_unfinished_requests():
        for d in core.step():
            assert (d.metrics is not None) == d.finished, "metrics ride on the terminal delta"
            if d.finished:
                metrics[d.request_id] = d.metrics
    assert len(metrics) == 4
    for m in metrics.values():
        assert m.scheduled_time <= m.first_token_time <= m.finished_time
    assert sum(m.num_preemptions for m in metrics.values()) == core.scheduler.num_preemptions > 0
    recomputed = [m.num_recomputed_tokens for m in metrics.values() if m.num_preemptions]
    assert sum(recomputed) > 0  # the prefix cache may hand back some of the dropped blocks
    assert all(m.num_recomputed_tokens == 0 for m in metrics.values() if not m.num_preemptions)


def test_priority_then_arrival_order(make_core):
    core = make_core(max_num_seqs=1)
    add(core, "late-low", prompt(5), priority=1)
    add(core, "high", prompt(5), priority=0)
    add(core, "high-2", prompt(5), priority=0)
    order = []
    while core.has_unfinished_requests():
        for d in core.step():
            if d.finished:
                order.append(d.request_id)
    assert order == ["high", "high-2", "late-low"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [10**9]}, "token ids"),
        ({"prompt_token_ids": list(range(100, 612))}, "context length"),
        ({"sampling": SamplingParams(max_tokens=500)}, "exceeds the context"),
        ({"sampling": SamplingParams(logprobs=20)}, None),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(make_core, bad, message):
    core = make_core(max_model_len=512, max_logprobs=5)
    msg = dict(request_id="bad", prompt_token_ids=prompt(20), sampling=GREEDY) | bad
    with pytest.raises(ValueError, match=message or "logprobs"):
        core.add_request(AddRequest(**msg))
    add(core, "good", prompt(8))
    outputs, finish = run_to_end(core)
    assert finish == {"good": "length"} and len(outputs["good"]) == 12


def test_duplicate_request_id_is_rejected(make_core):
    core = make_core()
    add(core, "x", prompt(4))
    with pytest.raises(ValueError, match="already in use"):
        add(core, "x", prompt(4))


def test_context_is_lowered_to_what_the_pool_holds(make_core, caplog):
    core = make_core(num_gpu_blocks=5, block_size=4)  # the model has 512 positions
    assert core.max_model_len == 20 and core.scheduler.config.max_model_len == 20
    assert "max_model_len lowered" in caplog.text
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        make_core(num_gpu_blocks=3, block_size=4)  # 12 tokens: not even a tiny context


def test_request_larger_than_the_pool_is_rejected(make_core):
    core = make_core(num_gpu_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        add(core, "big", prompt(10), SamplingParams(max_tokens=10))


def test_tiny_model_greedy_parity_with_hf(make_core, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [prompt(n, n) for n in (1, 3, 16, 17, 45, 90)]
    core = make_core(max_num_batched_tokens=32, block_size=16)
    for i, p in enumerate(prompts):
        add(core, str(i), p)
    outputs, _ = run_to_end(core)
    for i, p in enumerate(prompts):
        inp = torch.tensor([p])
        ref = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=12,
                          min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert outputs[str(i)] == ref[0, len(p):].tolist(), f"prompt {i}"


def peak_blocks_in_use(core) -> tuple[dict[tuple[str, int], list], int]:
    """(token, logprob) per choice, and the most blocks held at once."""
    outputs: dict[tuple[str, int], list] = {}
    peak = 0
    while core.has_unfinished_requests():
        for d in core.step():
            logprobs = [p.logprob for p in d.logprobs or []]
            outputs.setdefault((d.request_id, d.index), []).extend(
                zip(d.new_token_ids, logprobs, strict=True))
        peak = max(peak, core.num_gpu_blocks - core.kv.num_free_blocks)
    return outputs, peak


def test_n_choices_share_prompt_blocks_and_match_single_requests(make_core):
    p = prompt(70, 3)  # 4 full blocks of 16 and a partial one, shared by all choices
    # a peaked tiny model: a high temperature for diverse choices; logprobs expose the KV
    params = dict(temperature=8.0, max_tokens=20, ignore_eos=True, logprobs=0)
    shared = make_core(enable_prefix_caching=False)
    add(shared, "g", p, SamplingParams(n=4, seed=100, **params))
    grouped, peak_shared = peak_blocks_in_use(shared)
    singles = make_core(enable_prefix_caching=False)
    for i in range(4):
        add(singles, f"s{i}", p, SamplingParams(seed=100 + i, **params))
    alone, peak_alone = peak_blocks_in_use(singles)
    for i in range(4):
        got, want = grouped[("g", i)], alone[(f"s{i}", 0)]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert len({tuple(v) for v in grouped.values()}) > 1  # the choices really differ
    print(f"peak KV blocks: n=4 shared {peak_shared}, four requests {peak_alone}")
    # 5 prompt blocks held once instead of 4 times, the partial one copied on first write
    assert peak_shared <= peak_alone - 3 * 4
    assert shared.kv.num_free_blocks == shared.num_gpu_blocks


def test_best_of_reports_cumulative_logprobs(make_core):
    core = make_core()
    add(core, "b", prompt(9), SamplingParams(n=1, best_of=3, seed=1, temperature=1.0,
                                            max_tokens=5, ignore_eos=True))
    finals = {}
    while core.has_unfinished_requests():
        for d in core.step():
            if d.finished:
                finals[d.index] = d.cumulative_logprob
    assert sorted(finals) == [0, 1, 2]
    assert all(v is not None and v < 0 for v in finals.values())


def test_abort_ends_every_choice(make_core):
    core = make_core()
    add(core, "g", prompt(9), SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    core.step()
    core.step()
    deltas = core.abort_requests(["g"])
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert core.kv.num_free_blocks == core.num_gpu_blocks


def reference_beam_search(hf, prompt_ids, width, steps):
    """Beam search with HF's full forward for every beam (no KV cache, no sharing)."""
    beams = [([], 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            logits = hf(torch.tensor([prompt_ids + tokens])).logits[0, -1].float()
            top = logits.log_softmax(-1).topk(2 * width)
            candidates += [(score + float(lp), tokens + [int(t)])
                           for lp, t in zip(top.values, top.indices, strict=True)]
        candidates.sort(key=lambda c: -c[0])
        beams = [(t, s) for s, t in candidates[:width]]
    return beams


def test_beam_search_matches_a_reference_without_kv_sharing(make_core, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    p = prompt(21, 4)  # the shared partial block is copied on the beams' first writes
    core = make_core(block_size=16)
    add(core, "beam", p, SamplingParams(n=3, use_beam_search=True, max_tokens=6,
                                        ignore_eos=True, length_penalty=0.0))
    finals = {}
    while core.has_unfinished_requests():
        for d in core.step():
            assert d.finished, "beam search streams nothing before it ends"
            finals[d.index] = (d.new_token_ids, d.cumulative_logprob)
    with torch.no_grad():
        expected = reference_beam_search(hf, p, 3, 6)
    assert [finals[i][0] for i in range(3)] == [t for t, _ in expected]
    for i, (_, score) in enumerate(expected):
        assert abs(finals[i][1] - score) < 1e-3
    assert core.kv.num_free_blocks == core.num_gpu_blocks


def test_beam_search_abort_ends_every_beam(make_core):
    core = make_core()
    add(core, "beam", prompt(9), SamplingParams(n=2, use_beam_search=True, max_tokens=50,
                                                ignore_eos=True))
    for _ in range(4):
        assert core.step() == []
    assert sorted(d.index for d in core.abort_requests(["beam"])) == [0, 1]
    assert core.kv.num_free_blocks == core.num_gpu_blocks
