"""`/v1/responses` on the bundled model (SmolLM2, real weights) with the official `openai` SDK:
`responses.parse` with a pydantic model, a function tool round trip, and a
`previous_response_id` chain whose second turn the prefix cache serves."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.serve_support import bundled_server

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with bundled_server("--max-model-len", "1024", "--num-gpu-blocks", "256",
                        "--max-num-seqs", "4") as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_parse_tools_and_a_chain(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="", input="Name a city in France.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="", input=ask, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60,
                                    temperature=0)
    [call] = first.output
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model="", tools=[WEATHER], max_output_tokens=30, temperature=0,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp_c": 21}'}])
    assert second.status in ("completed", "incomplete") and second.output
    # the first turn (with its tools block and call) is the prefix of the second's prompt
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 2
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
