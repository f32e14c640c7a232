"""`--reasoning-parser` reaches each chat Job (Gateway.prepare), told how the prompt ends."""

from __future__ import annotations

import pytest
from gateway_fakes import FakeEngine

from gateway.choice_events import ChoiceEvents, ReasoningDelta, TextDelta
from gateway.generation import Piece
from gateway.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.service import Gateway
from gateway.settings import GatewaySettings

MESSAGES = [ChatMessage(role="user", content="hi")]


def _gateway(engine: FakeEngine, parser: str | None) -> Gateway:
    return Gateway(engine, GatewaySettings(reasoning_parser=parser))  # type: ignore[arg-type]


def _split(job, text: str) -> tuple[str, str]:
    ev = ChoiceEvents(job)
    out = ev.feed(Piece(text, [1, 2], finish_reason="stop"))
    return ("".join(e.text for e in out if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in out if isinstance(e, TextDelta)))


async def test_prepare_sets_the_parser(fake_engine: FakeEngine) -> None:
    gw = _gateway(fake_engine, "deepseek_r1")
    job = await gw.prepare(ChatCompletionRequest(messages=MESSAGES))
    assert job.reasoning_parser is not None
    assert _split(job, "so</think>yes") == ("so", "yes")
    plain = await _gateway(fake_engine, None).prepare(
        ChatCompletionRequest(messages=MESSAGES))
    assert plain.reasoning_parser is None
    completion = await gw.prepare(CompletionRequest(prompt="hi"))
    assert completion.reasoning_parser is None  # NOTE: chat only, as vLLM


async def test_a_prompt_that_ends_the_thinking(fake_engine: FakeEngine) -> None:
    # a template that writes an empty block (Qwen3's enable_thinking: false) leaves no reasoning
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    gw = Gateway(fake_engine, GatewaySettings(reasoning_parser="deepseek_r1",
                                              chat_template=template))
    off = await gw.prepare(ChatCompletionRequest(
        messages=MESSAGES, chat_template_kwargs={"enable_thinking": False}))
    assert _split(off, "so</think>yes") == ("", "so</think>yes")
    on = await gw.prepare(ChatCompletionRequest(messages=MESSAGES))
    assert _split(on, "so</think>yes") == ("so", "yes")


@pytest.mark.parametrize("key", ["thinking", "enable_thinking"])
async def test_deepseek_v3_reasons_only_when_asked(fake_engine: FakeEngine, key: str) -> None:
    # NOTE: vLLM's deepseek_v3 parser reads either key (`thinking` is DeepSeek's template's)
    gw = _gateway(fake_engine, "deepseek_v3")
    for unasked in (None, {key: False}):
        job = await gw.prepare(ChatCompletionRequest(messages=MESSAGES,
                                                     chat_template_kwargs=unasked))
        assert job.reasoning_parser is None
    asked = await gw.prepare(ChatCompletionRequest(
        messages=MESSAGES, chat_template_kwargs={key: True}))
    assert _split(asked, "so</think>yes") == ("so", "yes")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        GatewaySettings(reasoning_parser="nope")
