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
