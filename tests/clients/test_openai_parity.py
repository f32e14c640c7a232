"""OpenAI/vLLM request fields over a real server (the tiny model) with the official client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from tiny_server import MODEL_NAME, running_server, tiny_model_dir

pytestmark = pytest.mark.timeout(300)

PROMPT_IDS = [1, 504, 3458, 282, 253, 1012, 28, 2463]  # token ids (any in the vocabulary)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server("--max-logprobs", "30") as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    return LLM(str(tiny_model_dir()), max_model_len=512, num_gpu_blocks=64, num_threads=1)


def test_n_choices_streamed_and_not(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", n=3,
                                      max_tokens=6, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    assert len({c.text for c in reply.choices}) > 1  # three different samples
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2]
    ends = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 15


def test_stop_token_text_equals_in_process_llm(client: openai.OpenAI, llm) -> None:
    from engine import SamplingParams

    greedy = llm.generate({"prompt_token_ids": PROMPT_IDS},
                          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    ids = greedy.token_ids
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            stop_token_ids=(ids[k],))
    local = llm.generate({"prompt_token_ids": PROMPT_IDS}, params)[0]
    served = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]}).choices[0]
    assert local.token_ids == ids[: k + 1] and served.finish_reason == "stop"
    assert served.text == local.text


def test_max_logprobs_flag_reaches_the_gateway(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logprobs=25)
    assert len(reply.choices[0].logprobs.top_logprobs[0]) >= 20
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logprobs=31)
    assert err.value.body["param"] == "logprobs"


def test_models_by_id(url: str) -> None:
    assert httpx.get(f"{url}/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    missing = httpx.get(f"{url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_logit_bias_banning_the_greedy_token_changes_it(client: openai.OpenAI, url: str) -> None:
    def ids_of(text: str) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]

    def first(**extra) -> tuple[str, str]:
        reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1,
                                          temperature=0, logprobs=0, **extra)
        return reply.choices[0].text, reply.choices[0].logprobs.tokens[0]

    _, token = first()
    ids = ids_of(token)
    assert len(ids) == 1
    _, banned_token = first(logit_bias={str(ids[0]): -100})
    assert banned_token != token
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user",
                                                                       "content": "hi"}],
                                          max_tokens=1, temperature=0)
    greedy = chat.choices[0].message.content
    greedy_ids = ids_of(greedy)
    biased = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        temperature=0, logit_bias={str(greedy_ids[0]): -100})
    assert biased.choices[0].message.content != greedy


def test_batched_prompts(client: openai.OpenAI) -> None:
    single = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4,
                                        temperature=0).choices[0].text
              for p in ("Once upon", "The sky")]
    batched = client.completions.create(model=MODEL_NAME, prompt=["Once upon", "The sky"],
                                        max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert [c.text for c in batched.choices] == [single[0]] * 2 + [single[1]] * 2
    assert batched.usage.completion_tokens == 16


def test_echo_logprobs_equal_the_engines_prompt_logprobs(client: openai.OpenAI, llm) -> None:
    from engine import SamplingParams

    local = llm.generate({"prompt_token_ids": PROMPT_IDS},
                         SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1,
                                      temperature=0, echo=True, logprobs=1)
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT_IDS) + 1
    for j in range(1, len(PROMPT_IDS)):
        assert lp.token_logprobs[j] == pytest.approx(local.prompt_logprobs[j][PROMPT_IDS[j]],
                                                     abs=1e-4)
    assert reply.choices[0].text.endswith(local.text)
    # vLLM's prompt_logprobs field, streamed: in each choice's first chunk
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=2,
                                       temperature=0, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream]
    shown = firsts[0]
    assert shown[0] is None and len(shown) == len(PROMPT_IDS)
    for j in range(1, len(PROMPT_IDS)):
        entry = shown[j][str(PROMPT_IDS[j])]
        assert entry["logprob"] == pytest.approx(local.prompt_logprobs[j][PROMPT_IDS[j]],
                                                 abs=1e-4)
    assert all(f is None for f in firsts[1:])


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("suffix", "the end"), ("guided_json", {"type": "object"})])
def test_refused_fields_name_the_param(client: openai.OpenAI, field: str, value) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                  extra_body={field: value})
    assert err.value.status_code == 400 and err.value.body["param"] == field
