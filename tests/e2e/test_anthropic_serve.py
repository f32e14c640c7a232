"""Anthropic Messages on the bundled model (SmolLM2, real gateway + engine) with the official
`anthropic` SDK: create and stream give the same greedy reply, a forced tool_use / tool_result
round trip, count_tokens equal to the prompt the request reports, structured output."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.serve_support import bundled_server

pytestmark = pytest.mark.timeout(300)

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client() -> Iterator[anthropic.Anthropic]:
    with bundled_server("--max-model-len", "1024", "--num-gpu-blocks", "256",
                        "--max-num-seqs", "8") as (url, _), \
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                                timeout=120) as c:
        yield c


def _model(client: anthropic.Anthropic) -> str:
    """The served model's name (from the OpenAI-shaped /v1/models)."""
    return httpx.get(f"{client.base_url}/v1/models").json()["data"][0]["id"]


def test_create_and_stream_agree(client: anthropic.Anthropic) -> None:
    model = _model(client)
    ask = [{"role": "user", "content": "Name three colors."}]
    reply = client.messages.create(model=model, max_tokens=24, messages=ask,
                                   system="You are a helpful assistant.", extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].text.strip()
    with client.messages.stream(model=model, max_tokens=24, messages=ask,
                                system="You are a helpful assistant.",
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text == final.content[0].text
    assert final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_tool_round_trip_and_count_tokens(client: anthropic.Anthropic) -> None:
    model = _model(client)
    reply = client.messages.create(model=model, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    call = reply.content[-1]
    assert reply.stop_reason == "tool_use" and call.type == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    turn = [*ASK, {"role": "assistant", "content": reply.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": json.dumps({"temp": 21})}]}]
    answer = client.messages.create(model=model, max_tokens=20, messages=turn, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=model, messages=turn, tools=[WEATHER])
    used = answer.usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)
    # the second turn re-sends the first: the prefix cache serves part of it
    assert (used.cache_read_input_tokens or 0) > 0


def test_output_config_format_is_json(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"]}
    reply = client.messages.create(model=_model(client), max_tokens=40,
                                   messages=[{"role": "user", "content": "A color, as JSON."}],
                                   output_config={"format": {"type": "json_schema",
                                                             "schema": schema}})
    jsonschema.validate(json.loads(reply.content[0].text), schema)
