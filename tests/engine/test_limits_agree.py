"""The engine and the gateway refuse a request past a limit in the same words (issue 26: one
limits check): the engine's ValueError is the text of the gateway's 400, which names the
route's own field."""

from __future__ import annotations

import msgspec
import pytest

from engine.core import EngineCore
from gateway.errors import ApiError
from gateway.requests import ChatCompletionRequest, CompletionRequest
from gateway.validate import check_limits, to_sampling
from ipc.config import EngineConfig
from ipc.limits import Limits
from ipc.messages import AddRequest

# (completions request fields, prompt ids) -> the param the gateway names; the prompt's
# length decides the context check
CASES = [
    ({"max_tokens": 500}, 20, "max_tokens"),
    ({"max_tokens": None}, 512, "prompt"),
    ({"logprobs": 6}, 4, "logprobs"),
    ({"stop_token_ids": [3, 10**6]}, 4, "stop_token_ids[1]"),
    ({"logit_bias": {"10000000": 1.0}}, 4, "logit_bias.10000000"),
]


@pytest.fixture(scope="module")
def core(tiny_model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=512,
                                   max_logprobs=5))


@pytest.mark.parametrize(("fields", "prompt_len", "param"), CASES)
def test_engine_and_gateway_refuse_in_one_wording(core, fields, prompt_len, param):
    request = msgspec.convert({"prompt": "x", **fields}, CompletionRequest)
    prompt = list(range(1, prompt_len + 1))
    sampling = to_sampling(request, request.max_tokens)
    with pytest.raises(ValueError) as engine:
        core.add_request(AddRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling))
    limits = Limits(core.max_model_len, core.config.max_logprobs, core.model_config.vocab_size)
    with pytest.raises(ApiError) as gateway:
        check_limits(request, limits, prompt, sampling)
    assert gateway.value.message == str(engine.value)
    assert (gateway.value.status, gateway.value.param) == (400, param)


def test_chat_names_its_own_fields():
    request = msgspec.convert({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                               "top_logprobs": 6, "max_completion_tokens": 600},
                              ChatCompletionRequest)
    sampling = to_sampling(request, request.requested_max_tokens)
    limits = Limits(512, 5, 1000)
    with pytest.raises(ApiError) as context:
        check_limits(request, limits, [1] * 20, sampling)
    assert (context.value.param, context.value.code) == ("max_completion_tokens",
                                                         "context_length_exceeded")
    with pytest.raises(ApiError) as full:
        check_limits(request, limits, [1] * 512, sampling)
    assert full.value.param == "messages"
    with pytest.raises(ApiError) as logprobs:
        check_limits(request, limits, [1] * 20, to_sampling(request, 10))
    assert logprobs.value.param == "top_logprobs"
