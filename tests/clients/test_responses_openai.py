"""`POST /v1/responses` over a real server (the tiny model) with the official `openai` SDK
parsing every reply and event into its own types: plain and streamed, `responses.parse` with a
pydantic model, a function tool round trip, a `previous_response_id` chain on the prefix cache,
GET / DELETE / 404, refused fields in OpenAI's error shape, and a disconnect that aborts."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pagedserve_client as ps
import pydantic
import pytest
from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from tiny_server import MODEL_NAME, metric, wait_idle

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=99_999)


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_create_is_the_chat_request_it_translates_to(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL_NAME, instructions="Be brief.", input="Hello",
                                    max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello"}])
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in reply.output] == ["message"]
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == 8
    assert reply.usage.total_tokens == reply.usage.input_tokens + 8
    assert reply.instructions == "Be brief." and reply.max_output_tokens == 8


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL_NAME, input="Tell me a story",
                                    max_output_tokens=6, **GREEDY)
    events = list(client.responses.create(model=MODEL_NAME, input="Tell me a story",
                                          max_output_tokens=6, stream=True, **GREEDY))
    kinds = [type(e) for e in events]
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert kinds == [ResponseCreatedEvent, ResponseInProgressEvent,
                     ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent,
                     *[ResponseTextDeltaEvent] * len(deltas), ResponseTextDoneEvent,
                     ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent,
                     ResponseIncompleteEvent]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == events[-4].text == final.output_text
    assert final.output_text == whole.output_text and final.id == events[0].response.id
    assert final.usage.output_tokens == 6
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.responses.parse(model=MODEL_NAME, input="A city, as JSON", text_format=City,
                                   max_output_tokens=120, temperature=0)
    assert reply.status == "completed"
    assert isinstance(reply.output_parsed, City)
    jsonschema.validate(json.loads(reply.output_text), City.model_json_schema())


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=80, temperature=0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=MODEL_NAME, tools=[WEATHER], max_output_tokens=8, temperature=0, store=False,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp_c": 21}'}])
    assert second.status in ("completed", "incomplete")
    # the call and its result are in the prompt: more input than the first turn's whole text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_named_tool_choice_streams_the_arguments(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL_NAME, input="Weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=80, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds.count("response.function_call_arguments.done") == 1
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == final.output[0].arguments
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])


def test_previous_response_id_reuses_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Tell me a long story about a cat",
                                    max_output_tokens=24, **GREEDY)
    second = client.responses.create(model=MODEL_NAME, input="And then?", max_output_tokens=4,
                                     previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    # the first turn (its input and output) is re-sent: the engine finds it cached
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 2
    assert first.usage.input_tokens_details.cached_tokens < cached
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"


def test_retrieve_delete_and_404(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(reply.id, stream=True)
    assert refused.value.body["param"] == "stream"
    client.responses.delete(reply.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as err:
            call(reply.id)
        assert err.value.body["type"] == "not_found_error"
        assert err.value.body["code"] == "response_not_found"


BAD = [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the template does not read it
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"model": "other"}, "model"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_refused_and_invalid_fields_name_the_field(server_url: str, fields: dict,
                                                   param: str) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, **fields}
    for stream in (False, True):
        reply = httpx.post(f"{server_url}/v1/responses", json={**body, "stream": stream},
                           timeout=60)
        assert reply.status_code in (400, 404), reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, error


def test_not_json_and_a_missing_input_are_400s(server_url: str) -> None:
    for body in (b"{", b"[]", b"{}", b'{"input": 3}'):
        reply = httpx.post(f"{server_url}/v1/responses", content=body,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def _engine_tokens(url: str) -> float:
    """Tokens the engine has sampled (its own cumulative count)."""
    text = httpx.get(f"{url}/metrics").text
    [value] = re.findall(r'^vllm:generation_tokens_total\{model_name="[^"]*"\} (\S+)$', text,
                         re.M)
    return float(value)


def test_a_disconnect_mid_stream_aborts_the_request(server_url: str) -> None:
    most = 4000  # NOTE: the context (4096) less the prompt: the engine stops there at the latest
    before = _engine_tokens(server_url)
    body = {"model": MODEL_NAME, "input": "Tell me a story", "max_output_tokens": most,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server_url}/v1/responses", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
        assert metric(server_url, "pagedserve_requests_running") == 1
    assert wait_idle(server_url, timeout=120) == 0
    assert _engine_tokens(server_url) - before < most  # it ended before its max: aborted


async def test_pagedserve_sdk_responses(server_url: str, client: openai.OpenAI) -> None:
    """pagedserve's own SDK: the same response as openai's, streamed and not, sync and async."""
    reference = client.responses.create(model=MODEL_NAME, input="Hi there", max_output_tokens=5,
                                        **GREEDY)
    with ps.Client(server_url, max_retries=0) as sdk:
        reply = sdk.responses.create(input="Hi there", max_output_tokens=5, temperature=0,
                                     ignore_eos=True)
        assert reply.status == "incomplete" and reply.output_text == reference.output_text
        assert reply.usage.input_tokens == reference.usage.input_tokens
        with sdk.responses.create(input="Hi there", max_output_tokens=5, temperature=0,
                                  ignore_eos=True, stream=True) as stream:
            events = list(stream)
        assert stream.request_id == events[0].response.id
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
            reference.output_text == events[-1].response.output_text
        assert sdk.responses.retrieve(reply.id).output_text == reply.output_text
        assert sdk.responses.delete(reply.id).deleted
        with pytest.raises(ps.NotFoundError):
            sdk.responses.retrieve(reply.id)
    async with ps.AsyncClient(server_url, max_retries=0) as sdk:
        tool = await sdk.responses.create(input="Weather?", tools=[WEATHER], temperature=0,
                                          tool_choice="required", max_output_tokens=80)
        [call] = tool.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        stream = await sdk.responses.create(input="Hi there", max_output_tokens=5, stream=True,
                                            temperature=0, ignore_eos=True)
        async with stream:
            kinds = [e.type async for e in stream]
        assert kinds[-1] == "response.incomplete"
        with pytest.raises(ps.BadRequestError):
            await sdk.responses.create(input="Hi", background=True)


def test_the_cancel_route_ends_a_stream_as_cancelled(server_url: str,
                                                    client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL_NAME, input="Tell me a story", stream=True,
                                     max_output_tokens=4000, extra_body={"ignore_eos": True})
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 5:
            rid = events[0].response.id
            assert httpx.post(f"{server_url}/v1/requests/{rid}/cancel").json()["cancelled"]
    ends = [e for e in events if e.type in ("response.completed", "response.incomplete",
                                             "response.failed")]
    assert ends == [events[-1]] and events[-1].type == "response.failed"
    assert events[-1].response.status == "cancelled"
    assert events[-1].response.error.code == "cancelled"
    assert events[-1].response.usage.output_tokens < 4000
    assert wait_idle(server_url, timeout=60) == 0
