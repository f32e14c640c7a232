"""The OpenAI Agents SDK against a real server (the tiny model): an agent on its default model
class (`OpenAIResponsesModel`, i.e. `POST /v1/responses`) that calls a function tool."""

from __future__ import annotations

from typing import Annotated

import agents
import pydantic
import pytest
from agents import Agent, ModelSettings, Runner, function_tool
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI
from tiny_server import MODEL_NAME

pytestmark = pytest.mark.timeout(300)


async def test_an_agent_calls_a_function_tool(server_url: str) -> None:
    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=12)]) -> str:
        """The weather of a city."""
        calls.append(city)
        return "sunny, 21 C"

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=f"{server_url}/v1", api_key="none",
                                                 max_retries=0))
    # NOTE: a random model calls a tool only when forced (tool_choice required; the call's
    # grammar decides every token until it closes). The SDK then resets tool_choice to auto
    # and sends the call and its output back; a random model would not end a text answer
    # before max_tokens (the SDK fails an incomplete response), so a logit_bias on EOS (id 2)
    # ends that turn at once. max_turns bounds the run.
    agent = Agent(name="weather", instructions="Answer with the weather.", model=MODEL_NAME,
                  tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", max_tokens=120,
                                               temperature=0,
                                               extra_body={"logit_bias": {"2": 100}}))
    result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert len(calls) == 1 and len(calls[0]) <= 12
    first, second = result.raw_responses
    assert first.response_id.startswith("resp_")
    assert [item.type for item in first.output] == ["function_call"]
    assert [item.type for item in second.output] == ["message"]
    assert result.final_output == ""
    # the second turn's prompt holds the call and the tool's output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    model = agents.OpenAIProvider().get_model(MODEL_NAME)
    assert isinstance(model, OpenAIResponsesModel)  # the default: the Responses API
