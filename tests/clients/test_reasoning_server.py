"""A real `pagedserve serve --reasoning-parser qwen3` on the tiny thinking Qwen3, read by the
openai SDK: reasoning_content apart from content (stream and not), reasoning tokens counted,
enable_thinking false honoured, and a json_schema answer after the reasoning.

The random model does not think by itself: the assistant's turn is prefilled with `<think>`
(continue_final_message) and logit_bias on `</think>` ends the reasoning after a few tokens.
The reference split comes from the tokens' own texts (logprobs), cut with str.partition.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from tiny_server import running_server

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_qwen3 import tiny_qwen3_dir  # noqa: E402

END_ID = 49153  # </think> in tests/tiny_qwen3.py
PREFILL = [{"role": "user", "content": "Is 7 prime?"},
           {"role": "assistant", "content": "<think>"}]
THINK = dict(messages=PREFILL, max_tokens=60, logit_bias={str(END_ID): 9},
             extra_body={"continue_final_message": True, "add_generation_prompt": False})
SCHEMA = {"type": "object", "properties": {"prime": {"type": "boolean"},
                                           "why": {"enum": ["divisors", "guess"]}},
          "required": ["prime", "why"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_server("--model", str(tiny_qwen3_dir()), "--max-model-len", "512",
                        "--reasoning-parser", "qwen3") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _thinking(client: openai.OpenAI, **kw):
    """The first of a few seeds whose reply reasons before it ends (bounded)."""
    for seed in range(1, 9):
        reply = client.chat.completions.create(model="tiny-llama", seed=seed, logprobs=True,
                                               **{**THINK, **kw})
        texts = [t.token for t in reply.choices[0].logprobs.content]
        if "</think>" in texts and texts.index("</think>") > 0:
            return seed, reply, texts
    raise AssertionError("no seed reasoned before </think>")


def test_reasoning_is_split_from_content(client: openai.OpenAI) -> None:
    seed, reply, texts = _thinking(client)
    want_reasoning, _, want_content = "".join(texts).partition("</think>")
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == want_reasoning
    assert message.model_extra["reasoning"] == want_reasoning  # vLLM's newer name
    assert (message.content or "") == want_content
    details = reply.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == texts.index("</think>")

    stream = client.chat.completions.create(model="tiny-llama", seed=seed, stream=True,
                                            stream_options={"include_usage": True}, **THINK)
    reasoning, content, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning.append(extra.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == want_reasoning
    assert "".join(content) == want_content
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == \
        details.reasoning_tokens


def test_enable_thinking_false_is_all_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny-llama", seed=1, logprobs=True, messages=PREFILL[:1], max_tokens=12,
        logit_bias={str(END_ID): 9}, extra_body={"chat_template_kwargs": {
            "enable_thinking": False}})
    message = reply.choices[0].message
    texts = [t.token for t in reply.choices[0].logprobs.content]
    assert message.content == "".join(texts)
    assert message.model_extra["reasoning_content"] is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_json_schema_answer_after_reasoning(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for stream in (False, True):
        seed, reply, texts = _thinking(client, response_format=fmt, max_tokens=120)
        message = reply.choices[0].message
        assert message.model_extra["reasoning_content"] == "".join(texts).partition(
            "</think>")[0]
        jsonschema.validate(json.loads(message.content), SCHEMA)
        if stream:
            chunks = client.chat.completions.create(
                model="tiny-llama", seed=seed, stream=True, response_format=fmt, **{
                    **THINK, "max_tokens": 120})
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content == message.content


def test_a_forced_tool_call_after_reasoning(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "check", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                               "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}
    seed, reply, texts = _thinking(client, tools=[tool], tool_choice="required",
                                   parallel_tool_calls=False,
                                   max_tokens=120)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "".join(texts).partition(
        "</think>")[0]
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "check"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
