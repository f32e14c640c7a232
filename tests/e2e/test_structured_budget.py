"""Budget closing over the real server (bundled SmolLM2) with the official `openai` client:
at a max_tokens that cuts the JSON with `--no-structured-output-close-on-budget`, the default
server's reply parses (`parse()` with a Pydantic model); a forced tool call that the budget cuts
is never returned as a call (with closing or without: `length`, no tool_calls), while the same
call given room comes back whole and validates (`jsonschema`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.serve_support import bundled_server

pytestmark = pytest.mark.timeout(600)

FLAGS = ("--max-model-len", "1024", "--num-gpu-blocks", "128", "--max-num-seqs", "4")
ESSAY_ASK = [{"role": "user", "content": "Write a long, detailed essay about the history of "
                                         "Rome, with a title, a summary and many details."}]
SEARCH = {"type": "function", "function": {
    "name": "search_library", "description": "Search the library catalogue",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"query": {"type": "string"},
                                  "reason": {"type": "string"}},
                   "required": ["query", "reason"]}}}
SEARCH_ASK = [{"role": "user", "content": "Find me every book about the Roman empire, its "
                                          "emperors, wars, roads and daily life, and explain "
                                          "at length why each is worth reading."}]
SHORT_ASK = [{"role": "user", "content": "Search the library for books on Rome."}]
FORCED = {"type": "function", "function": {"name": "search_library"}}
MAX_TOKENS = 40  # NOTE: the greedy essay and call both run longer (checked with closing off)
ROOM = 200  # the greedy call to SHORT_ASK ends within this


class Essay(pydantic.BaseModel):
    title: str
    summary: str
    details: str


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def closing() -> Iterator[openai.OpenAI]:
    with bundled_server(*FLAGS) as (url, _):
        yield _client(url)


@pytest.fixture(scope="module")
def plain() -> Iterator[openai.OpenAI]:
    with bundled_server(*FLAGS, "--no-structured-output-close-on-budget") as (url, _):
        yield _client(url)


def _essay(client: openai.OpenAI, max_tokens: int) -> object:
    return client.chat.completions.parse(model="", messages=ESSAY_ASK, response_format=Essay,
                                         max_tokens=max_tokens, temperature=0)


def _call(client: openai.OpenAI, max_tokens: int, ask: list[dict] = SEARCH_ASK) -> object:
    return client.chat.completions.create(model="", messages=ask, tools=[SEARCH],
                                          tool_choice=FORCED, max_tokens=max_tokens,
                                          temperature=0)


def test_without_closing_the_budget_cuts_the_json(plain: openai.OpenAI) -> None:
    with pytest.raises(openai.LengthFinishReasonError) as caught:
        _essay(plain, MAX_TOKENS)
    text = caught.value.completion.choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)
    call = _call(plain, MAX_TOKENS).choices[0]
    # NOTE: the call as far as it got is not callable: it is dropped, the reply truncated
    assert call.finish_reason == "length" and not call.message.tool_calls, call


def test_parse_gets_a_whole_object_within_max_tokens(closing: openai.OpenAI) -> None:
    reply = _essay(closing, MAX_TOKENS)
    choice = reply.choices[0]
    assert isinstance(choice.message.parsed, Essay), choice.message.content
    jsonschema.validate(json.loads(choice.message.content), Essay.model_json_schema())
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens <= MAX_TOKENS
    # the budget shaped it: it is the reply cut short, then closed
    assert reply.usage.completion_tokens >= MAX_TOKENS - 1


def test_a_forced_tool_call_cut_by_the_budget_is_not_returned(closing: openai.OpenAI) -> None:
    """The closing makes the call's JSON whole, but its arguments are the engine's, not the
    model's: no API hands them to an agent as a call (gateway/choice_events.py)."""
    cut = _call(closing, MAX_TOKENS).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls, cut


def test_a_forced_tool_call_with_room_closes_its_arguments(closing: openai.OpenAI) -> None:
    reply = _call(closing, ROOM, SHORT_ASK)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "search_library"
    jsonschema.validate(json.loads(call.function.arguments), SEARCH["function"]["parameters"])
    assert reply.usage.completion_tokens <= ROOM
