"""Tool calls an agent can trust, through the official SDKs against a real server (the tiny
model): with tool_choice required, parallel calls and EOS banned (so the model opens call after
call until its budget cuts one), every max_tokens from 1 up returns only calls the model itself
finished (those of a long run of the same request, in order), never one the budget cut or the
budget closing completed; a reply with calls ends as calls (`tool_calls`, a completed Response,
`tool_use`), one without as truncated (`length`, `incomplete`, `max_tokens`).

The requests are greedy and the model sees the same prompt each time: the run before the
reference warms the prefix cache, so the reference and every budget's run compute alike."""

from __future__ import annotations

import json
from typing import Annotated

import agents
import anthropic
import jsonschema
import openai
import pydantic
import pytest
from agents import Agent, ModelSettings, Runner, function_tool
from tiny_server import MODEL_NAME

pytestmark = pytest.mark.timeout(600)

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                              "parameters": PARAMS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "strict": True,
                  "parameters": PARAMS}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather", "input_schema": PARAMS}
ASK = "Weather in Paris and in Rome?"
NO_EOS = {"logit_bias": {"2": -100}}  # NOTE: id 2 ends a turn; the closing still forces it
LONG = 160  # the reference run's budget: several calls, the last one cut
Calls = list[tuple[str, dict]]


def _chat(client: openai.OpenAI, max_tokens: int) -> tuple[Calls, str]:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
        tool_choice="required", max_tokens=max_tokens, temperature=0, extra_body=NO_EOS)
    choice = r.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls or []]
    return calls, choice.finish_reason


def _chat_stream(client: openai.OpenAI, max_tokens: int) -> tuple[Calls, str]:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
        tool_choice="required", max_tokens=max_tokens, temperature=0, extra_body=NO_EOS,
        stream=True)
    parts: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    reason = ""
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.function.name:
                    names[d.index] = d.function.name
                parts.setdefault(d.index, []).append(d.function.arguments or "")
            reason = choice.finish_reason or reason
    calls = [(names[i], json.loads("".join(parts[i]))) for i in sorted(parts)]
    return calls, reason


def _responses(client: openai.OpenAI, max_tokens: int) -> tuple[Calls, str]:
    r = client.responses.create(model=MODEL_NAME, input=ASK, tools=[RESPONSES_TOOL],
                                tool_choice="required", max_output_tokens=max_tokens,
                                temperature=0, extra_body=NO_EOS)
    calls = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    return calls, r.status


def _responses_stream(client: openai.OpenAI, max_tokens: int) -> tuple[Calls, str]:
    stream = client.responses.create(model=MODEL_NAME, input=ASK, tools=[RESPONSES_TOOL],
                                     tool_choice="required", max_output_tokens=max_tokens,
                                     temperature=0, extra_body=NO_EOS, stream=True)
    calls, status = [], ""
    for event in stream:
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            calls.append((event.item.name, json.loads(event.item.arguments)))
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            status = event.response.status
    return calls, status


def _anthropic(client: anthropic.Anthropic, max_tokens: int) -> tuple[Calls, str]:
    r = client.messages.create(model=MODEL_NAME, max_tokens=max_tokens, tools=[ANTHROPIC_TOOL],
                               messages=[{"role": "user", "content": ASK}],
                               tool_choice={"type": "any"},
                               extra_body={**NO_EOS, "temperature": 0})
    return [(b.name, b.input) for b in r.content if b.type == "tool_use"], r.stop_reason


ENDS = {  # (ending with calls, ending without)
    "chat": (_chat, "tool_calls", "length"),
    "chat_stream": (_chat_stream, "tool_calls", "length"),
    "responses": (_responses, "completed", "incomplete"),
    "responses_stream": (_responses_stream, "completed", "incomplete"),
    "anthropic": (_anthropic, "tool_use", "max_tokens"),
}


@pytest.mark.parametrize("api", sorted(ENDS))
def test_only_finished_calls_are_returned_at_every_budget(server_url: str, api: str) -> None:
    run, with_calls, without = ENDS[api]
    client = (anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0)
              if api == "anthropic" else
              openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0))
    run(client, LONG)  # NOTE: warms the prefix cache: the runs below compute alike
    finished, _ = run(client, LONG)
    assert len(finished) >= 3, finished  # the model opened call after call
    for _, args in finished:
        jsonschema.validate(args, PARAMS)
    counts = set()
    for max_tokens in range(1, 110, 3):  # NOTE: a call is some 33 tokens here
        calls, end = run(client, max_tokens)
        assert calls == finished[: len(calls)], (max_tokens, calls)
        assert end == (with_calls if calls else without), (max_tokens, calls, end)
        counts.add(len(calls))
    assert {0, 1, 2, 3} <= counts  # budgets that cut the first, second, third, fourth call


def test_an_agent_runs_only_calls_the_model_finished(server_url: str) -> None:
    """The OpenAI Agents SDK executes every function_call it receives; at small budgets it
    must receive only finished ones (or an incomplete response it refuses)."""
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)
    finished = [args["city"] for _, args in _responses(client, LONG)[0]]
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(
        base_url=f"{server_url}/v1", api_key="none", max_retries=0))
    seen: list[list[str]] = []
    for max_tokens in range(10, 80, 10):
        cities: list[str] = []

        @function_tool
        def get_weather(city: Annotated[str, pydantic.Field(max_length=12)]) -> str:
            """The weather."""
            cities.append(city)  # noqa: B023
            return "sunny"

        agent = Agent(name="w", instructions="", model=MODEL_NAME, tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens,
                                                   temperature=0, extra_body=NO_EOS))
        with pytest.raises(agents.exceptions.AgentsException):
            Runner.run_sync(agent, ASK, max_turns=1)  # one turn: its calls run, then it stops
        assert cities == finished[: len(cities)], (max_tokens, cities)
        seen.append(cities)
    assert any(seen) and not all(seen)
