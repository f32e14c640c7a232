"""The in-process LLM API on a tiny random Llama: prompt forms, stop strings, seeds, logprobs,
bad input."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, num_gpu_blocks=64)


def test_text_and_token_prompts_give_the_same_output(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = llm.tokenizer("Hello world")["input_ids"]
    by_text, by_ids = llm.generate(["Hello world", {"prompt_token_ids": ids}], params)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 8
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.finish_reason == "length"
    assert llm.generate("Hello world", params)[0].token_ids == by_text.token_ids
    m = by_text.outputs[0].metrics
    assert m.scheduled_time <= m.first_token_time <= m.finished_time and m.num_preemptions == 0


def test_stop_string_never_leaks_into_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("Once upon a time", params)[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text
    kept = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,),
        include_stop_str_in_output=True))[0]
    assert kept.text == out.text + stop
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == 64


def test_stop_token_ids_end_the_request(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate("abc", greedy)[0].token_ids
    stop = first[-1]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                             stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == first[: first.index(stop) + 1]


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    alone = llm.generate("The sky", seeded)[0].token_ids
    mixed = llm.generate(["Other text", "The sky", "More"], [other, seeded, other])[1].token_ids
    assert alone == mixed


def test_logprobs_per_token(llm):
    out = llm.generate("x y z", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                               ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and len(lp) >= 3
        assert max(lp.values()) == lp[tok]  # greedy picks the most likely


@pytest.mark.parametrize(
    "prompts, params",
    [
        ("", None),
        ([], None),
        ({"prompt_token_ids": []}, None),
        ({"prompt_token_ids": "abc"}, None),
        ({"text": "x"}, None),
        ({"prompt_token_ids": list(range(300))}, None),
        (["a", "b"], [SamplingParams()]),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_serving(llm, prompts, params):
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", -1), ("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0),
     ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("presence_penalty", 3.0),
     ("repetition_penalty", 0.0), ("temperature", float("nan")), ("logprobs", -1)],
)
def test_out_of_range_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_is_rejected(tiny_model_dir):
    with pytest.raises(TypeError):
        LLM(str(tiny_model_dir), no_such_option=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny_model_dir), max_num_seqs=0)


def test_n_choices_and_best_of(llm):
    params = SamplingParams(n=3, seed=5, temperature=50.0, max_tokens=6, ignore_eos=True)
    out = llm.generate("Tell me", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert out.text == out.outputs[0].text
    best = llm.generate("Tell me", SamplingParams(n=2, best_of=4, seed=5, temperature=50.0,
                                                  max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in best.outputs] == [0, 1]
    scores = [c.cumulative_logprob for c in best.outputs]
    assert scores == sorted(scores, reverse=True)


def test_stop_string_on_one_choice_stops_only_that_choice(llm):
    params = SamplingParams(n=2, seed=11, temperature=50.0, max_tokens=12, ignore_eos=True)
    first = llm.generate("Hi", params)[0].outputs
    stop = first[0].text[3:6]
    assert stop.strip() and stop not in first[1].text[:9]
    out = llm.generate("Hi", SamplingParams(n=2, seed=11, temperature=50.0, max_tokens=12,
                                            ignore_eos=True, stop=(stop,)))[0].outputs
    assert out[0].finish_reason == "stop"
    assert out[0].text == first[0].text[: first[0].text.index(stop)]
    assert llm.engine.kv.num_free_blocks == 64


def test_beam_search_outputs_ranked_choices(llm):
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=5, ignore_eos=True)
    out = llm.generate("The weather", params)[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert all(c.metrics.first_token_time <= c.metrics.finished_time for c in out.outputs)
    greedy = llm.generate("The weather", SamplingParams(temperature=0, max_tokens=5,
                                                         ignore_eos=True, logprobs=0))[0]
    greedy_score = sum(lp[t] for t, lp in zip(greedy.token_ids, greedy.logprobs, strict=True))
    assert scores[0] >= greedy_score - 1e-4  # the best beam is at least as likely as greedy
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=3, use_beam_search=True)
