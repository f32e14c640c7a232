"""`thinking` blocks from /v1/messages on `pagedserve serve --reasoning-parser qwen3` (the tiny
thinking Qwen3), read by the `anthropic` SDK, stream and not, and thinking disabled.

The random model does not think by itself: the assistant's turn is prefilled with `<think>`
(Anthropic's prefill: the reply continues it) and a logit_bias on `</think>` ends the
reasoning after a few tokens. The reference split is the same request's tokens on the chat
route (logprobs), cut with str.partition.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from tiny_server import running_server

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_qwen3 import tiny_qwen3_dir  # noqa: E402

pytestmark = pytest.mark.timeout(240)
END_ID = 49153  # </think> in tests/tiny_qwen3.py
ASK = {"role": "user", "content": "Is 7 prime?"}
PREFILL = [ASK, {"role": "assistant", "content": "<think>"}]
BIAS = {str(END_ID): 9}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server("--model", str(tiny_qwen3_dir()), "--max-model-len", "512",
                        "--reasoning-parser", "qwen3") as base:
        yield base


def _reference(url: str) -> tuple[int, str, str]:
    """A seed whose reply reasons before </think>, and its (reasoning, answer) by tokens."""
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for seed in range(1, 9):
        reply = chat.chat.completions.create(
            model="tiny-llama", seed=seed, logprobs=True, messages=PREFILL, max_tokens=40,
            logit_bias=BIAS, extra_body={"continue_final_message": True,
                                         "add_generation_prompt": False})
        texts = [t.token for t in reply.choices[0].logprobs.content]
        if "</think>" in texts and texts.index("</think>") > 0:
            reasoning, _, answer = "".join(texts).partition("</think>")
            return seed, reasoning, answer
    raise AssertionError("no seed reasoned before </think>")


def test_thinking_blocks_stream_and_not(url: str) -> None:
    seed, reasoning, answer = _reference(url)
    ask = dict(model="tiny-llama", max_tokens=40, messages=PREFILL,
               thinking={"type": "enabled", "budget_tokens": 40},
               extra_body={"seed": seed, "logit_bias": BIAS})
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
        reply = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    blocks = [b.to_dict() for b in reply.content]
    assert blocks[0] == {"type": "thinking", "thinking": reasoning, "signature": ""}
    assert "".join(b.get("text", "") for b in blocks[1:]) == answer.rstrip()
    assert "thinking_delta" in deltas
    assert [{k: v for k, v in b.to_dict().items() if k != "parsed_output"}
            for b in final.content] == blocks


def test_thinking_disabled_is_all_text(url: str) -> None:
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    want = chat.chat.completions.create(
        model="tiny-llama", seed=1, messages=[ASK], max_tokens=12, logit_bias=BIAS,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
        reply = client.messages.create(model="tiny-llama", max_tokens=12, messages=[ASK],
                                       thinking={"type": "disabled"},
                                       extra_body={"seed": 1, "logit_bias": BIAS})
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == want.choices[0].message.content.rstrip()
