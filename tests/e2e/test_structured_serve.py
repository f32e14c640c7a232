"""Structured outputs and tool calls over the real server (gateway + engine, bundled SmolLM2)
with the official `openai` client: parse() with a pydantic model, json_object, forced and
streamed tool calls, a tool round trip, strict calls under tool_choice auto, n=2, the
llama3_json and mistral formats, and grammars the engine refuses as 400s."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest
import websockets

from tests.e2e.serve_support import bundled_server

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Local time of a timezone",
                 "parameters": {"type": "object",
                                "properties": {"tz": {"type": "string", "maxLength": 20}},
                                "required": ["tz"], "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=99_999_999)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with bundled_server("--max-model-len", "1024", "--num-gpu-blocks", "256",
                        "--max-num-seqs", "8") as (base, _):
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=80, temperature=0)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and reply.choices[0].finish_reason == "stop"


def test_json_object_and_structured_outputs(client):
    reply = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")
    choice = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(
        model="", prompt="The date:", max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text[4] == "-"


def _check_call(call, tool: dict) -> None:
    assert call.type == "function"  # ids: call_<hex>, or 9 alphanumerics for Mistral
    assert call.id.startswith("call_") or (len(call.id) == 9 and call.id.isalnum())
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_and_named(client):
    reply = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0.8, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert len(named.choices[0].message.tool_calls) == 1
    _check_call(named.choices[0].message.tool_calls[0], TIME)


def test_streamed_tool_calls_reassemble(client):
    with client.chat.completions.stream(
            model="", messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0], WEATHER)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # NOTE: a call is sent once its JSON closed, whole (a cut call is never sent)
    assert len(deltas) == 1 and deltas[0].id == calls[0].id
    assert deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == calls[0].function.arguments


def test_tool_round_trip(client):
    first = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model="", messages=messages, tools=[WEATHER],
                                            max_tokens=20, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_refused_grammars_are_400s_naming_the_field(client, url):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=ASK, max_tokens=5,
                                       extra_body={"guided_json": {"type": "object"}})
    assert err.value.body["param"] == "guided_json"  # and the message names its replacement
    assert "structured_outputs" in err.value.body["message"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="", messages=ASK, max_tokens=5, stream=stream,
                extra_body={"structured_outputs": {"regex": "(unclosed"}})
        assert err.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="", messages=ASK, max_tokens=5, response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}})
    assert err.value.body["param"] == "response_format"
    ok = client.chat.completions.create(model="", messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"
    metrics = httpx.get(f"{url}/metrics").text
    assert "pagedserve_grammar_compile_seconds_count" in metrics
    assert "pagedserve_grammar_failures_total" in metrics
    # the three refused grammars were the client's fault (400s), not engine errors
    invalid = re.search(r'^pagedserve_requests_total\{finish_reason="invalid"\} (\S+)$',
                        metrics, re.M)
    assert invalid and float(invalid.group(1)) >= 3
    assert 'pagedserve_requests_total{finish_reason="error"}' not in metrics


async def test_websocket_generate_with_tools_and_a_refused_grammar(url):
    request = {"messages": ASK, "max_tokens": 80, "temperature": 0, "tools": [WEATHER],
               "tool_choice": "required", "parallel_tool_calls": False}
    bad = {"messages": ASK, "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws",
                                  subprotocols=["pagedserve.v1"]) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "generate", "id": "t", "request": request}))
        await ws.send(json.dumps({"type": "generate", "id": "b", "request": bad}))
        deltas, ends = [], {}
        while len(ends) < 2:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if frame["type"] == "generation.delta" and frame["id"] == "t":
                deltas += frame["chunk"]["choices"][0]["delta"].get("tool_calls", [])
            elif frame["type"] in ("generation.done", "error"):
                ends[frame["id"]] = frame
    assert ends["t"]["finish_reason"] == "tool_calls"
    assert ends["b"]["type"] == "error" and ends["b"]["error"]["param"] == "response_format"
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def _past_call(i: int, city: str) -> list[dict]:
    """A finished weather round in the conversation (its call lacks `unit`)."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temp": 20}'},
            {"role": "assistant", "content": f"It is 20 degrees in {city}."}]


def _valid(arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _auto_strict_calls(client) -> None:
    """The model, copying two past calls that lack `unit`, starts a call on its own
    (tool_choice auto): unconstrained it leaves `unit` out; with `strict` the grammar takes
    over once the call's opening is written and the call validates."""
    messages = [*_past_call(1, "Paris"), *_past_call(2, "Oslo"),
                {"role": "user", "content": "What is the weather in Rome?"}]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    calls = {}
    for tool in (WEATHER, strict):
        reply = client.chat.completions.create(model="", messages=messages, tools=[tool],
                                               max_tokens=60, temperature=0)
        assert reply.choices[0].finish_reason == "tool_calls"
        calls[tool is strict] = reply.choices[0].message.tool_calls
    assert len(calls[False]) == 1 and not _valid(calls[False][0].function.arguments)
    assert len(calls[True]) == 1 and _valid(calls[True][0].function.arguments)
    assert json.loads(calls[True][0].function.arguments)["city"] == "Rome"


def test_auto_with_a_strict_tool_constrains_the_call_it_starts(client):
    _auto_strict_calls(client)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    text = client.chat.completions.create(  # text replies stay free
        model="", messages=[{"role": "user", "content": "Write one sentence about cats."}],
        tools=[strict], max_tokens=30, temperature=0)
    assert text.choices[0].message.tool_calls is None
    assert "cat" in text.choices[0].message.content.lower()


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def format_client(request) -> Iterator[openai.OpenAI]:
    """A server whose --tool-call-parser is not Hermes: its fallback prompt, grammars and
    parser all use that format."""
    with bundled_server("--max-model-len", "1024", "--num-gpu-blocks", "128",
                        "--max-num-seqs", "4", "--tool-call-parser", request.param) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def test_other_formats_required_named_streamed_and_strict_auto(format_client):
    forced = format_client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert forced.choices[0].finish_reason == "tool_calls"
    call = forced.choices[0].message.tool_calls[0]
    _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    with format_client.chat.completions.stream(
            model="", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}}) as stream:
        deltas = [d for e in stream if e.type == "chunk"
                  for d in (e.chunk.choices[0].delta.tool_calls or [])]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0], TIME)
    assert deltas[0].function.name == "get_time" and deltas[0].id == calls[0].id
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    _auto_strict_calls(format_client)


def test_n2_with_a_schema_and_with_required_tools(client):
    reply = client.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, n=2, max_tokens=80, temperature=1.0, seed=5)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
        jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())
    assert reply.choices[0].message.content != reply.choices[1].message.content
    forced = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice="required", n=2, max_tokens=60,
        temperature=1.0, seed=3, parallel_tool_calls=False)
    assert [c.index for c in forced.choices] == [0, 1]
    for choice in forced.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0], WEATHER)
    assert forced.choices[0].message.tool_calls[0].id != forced.choices[1].message.tool_calls[0].id
