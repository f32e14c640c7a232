"""Reasoning in /v1/responses: `pagedserve serve --reasoning-parser deepseek_r1` on the tiny
thinking Qwen3, read by the openai SDK: a `reasoning` item before the `message`, streamed as
response.reasoning_text events, and reasoning tokens counted.

The random model does not think by itself: deepseek_r1 reads a reply as reasoning until
`</think>`, and logit_bias on `</think>` ends it after a few tokens. The reference split comes
from the tokens' own texts (chat logprobs of the same seeded request), cut with str.partition.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.responses import ResponseReasoningItem
from tiny_server import running_server

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_qwen3 import tiny_qwen3_dir  # noqa: E402

pytestmark = pytest.mark.timeout(300)
END_ID = 49153  # </think> in tests/tiny_qwen3.py
QUESTION = "Is 7 prime?"
BIAS = {str(END_ID): 9}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_server("--model", str(tiny_qwen3_dir()), "--max-model-len", "512",
                        "--reasoning-parser", "deepseek_r1") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _thinking(client: openai.OpenAI) -> tuple[int, list[str]]:
    """The first of a few seeds whose reply reasons before `</think>` (bounded), and the
    texts of its tokens."""
    for seed in range(1, 9):
        reply = client.chat.completions.create(
            model="", seed=seed, logprobs=True, max_tokens=40, logit_bias=BIAS,
            messages=[{"role": "user", "content": QUESTION}])
        texts = [t.token for t in reply.choices[0].logprobs.content]
        if "</think>" in texts and texts.index("</think>") > 0:
            return seed, texts
    raise AssertionError("no seed reasoned before </think>")


def test_reasoning_items_streamed_and_not(client: openai.OpenAI) -> None:
    seed, texts = _thinking(client)
    reasoning, _, answer = "".join(texts).partition("</think>")
    ask = dict(model="", input=QUESTION, max_output_tokens=40,
               extra_body={"seed": seed, "logit_bias": BIAS})
    reply = client.responses.create(**ask)
    first = reply.output[0]
    assert isinstance(first, ResponseReasoningItem)
    assert first.content[0].type == "reasoning_text" and first.content[0].text == reasoning
    assert reply.output_text == answer
    assert [o.type for o in reply.output] == ["reasoning"] + (["message"] if answer else [])
    assert reply.usage.output_tokens_details.reasoning_tokens == texts.index("</think>")

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        reasoning
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning and kinds.index("response.reasoning_text.done") < \
        kinds.index("response.output_text.delta" if answer else kinds[-1])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == answer
    assert final.usage.output_tokens_details.reasoning_tokens == texts.index("</think>")
