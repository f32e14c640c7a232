"""HTTP/SSE behaviour of the gateway app against a scripted engine, under a real uvicorn."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
REPLY = "Hello there, how are you today?"


def _app(engine: FakeEngine, **settings: object):
    return build_app(engine, GatewaySettings(**settings))  # type: ignore[arg-type]


async def _sse_events(response: httpx.Response) -> list[str]:
    body = (await response.aread()).decode()
    assert body.endswith("data: [DONE]\n\n")
    return [block for block in body.split("\n\n") if block]


async def test_openai_sdk_chat_and_models(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["test-model"]
        reply = await client.chat.completions.create(model="test-model", messages=CHAT["messages"])
        assert reply.choices[0].message.content == REPLY
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == len(fake_engine.reply_ids)
        stream = await client.chat.completions.create(
            model="test-model", messages=CHAT["messages"], stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].choices == []
        assert chunks[-1].usage.total_tokens == reply.usage.total_tokens


async def test_completions_length_and_logprobs(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await client.completions.create(model="test-model", prompt="Say", max_tokens=3,
                                                logprobs=1)
        assert reply.choices[0].finish_reason == "length"
        assert reply.choices[0].text == fake_engine.tokenizer.decode(fake_engine.reply_ids[:3])
        assert len(reply.choices[0].logprobs.tokens) == 3
        chat = await client.chat.completions.create(
            model="test-model", messages=CHAT["messages"], logprobs=True, top_logprobs=1,
            max_tokens=2)
        assert [t.logprob for t in chat.choices[0].logprobs.content] == [-0.5, -0.5]


async def test_sse_framing_and_stop_string(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        body = {**CHAT, "stream": True, "stop": [" how"]}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = await _sse_events(response)
        assert all(e.startswith("data: ") for e in events)
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == "Hello there,"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert set(fake_engine.aborted) == {chunks[0]["id"]}  # the engine request was stopped


async def test_ping_while_queued(fake_engine: FakeEngine) -> None:
    fake_engine.first_delay = 0.5
    async with serve(_app(fake_engine, sse_keepalive_interval=0.1)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": "x", "stream": True, "max_tokens": 2}) as response:
            events = await _sse_events(response)
        assert events[0] == ": ping" and events[-1] == "data: [DONE]"


async def test_engine_failure_mid_stream(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/chat/completions",
                               json={**CHAT, "stream": True}) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            fake_engine.kill()
            rest = [line async for line in lines if line]
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_error"
        assert rest[-1] == "data: [DONE]"
        assert (await http.get("/health")).status_code == 503
        response = await http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 0


async def test_disconnects_abort(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.2
    app = _app(fake_engine)
    async with serve(app) as url:
        for stream in (True, False):
            async with httpx.AsyncClient(base_url=url) as http:

                async def call(http: httpx.AsyncClient = http, stream: bool = stream) -> None:
                    body = {**CHAT, "stream": stream}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        await response.aread()

                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(call(), 0.5)
            for _ in range(50):
                if len(set(fake_engine.aborted)) == int(not stream) + 1:
                    break
                await asyncio.sleep(0.02)
            assert len(set(fake_engine.aborted)) == int(not stream) + 1
        assert app.state.gateway.generations == {}
        metrics = (await httpx.AsyncClient(base_url=url).get("/metrics")).text
        assert "pagedserve_client_disconnects_total 2.0" in metrics


async def test_cancel_endpoint(fake_engine: FakeEngine) -> None:
    fake_engine.interval = 0.05
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        task = asyncio.create_task(
            http.post("/v1/chat/completions", json={**CHAT, "request_id": "req-1"}))
        await asyncio.sleep(0.1)
        assert (await http.post("/v1/requests/req-1/cancel")).json()["cancelled"] is True
        reply = (await task).json()
        assert reply["choices"][0]["finish_reason"] == "abort"
        missing = await http.post("/v1/requests/nope/cancel")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


async def test_overload_is_503_with_retry_after(tokenizer_dir: Path) -> None:
    engine = FakeEngine(tokenizer_dir, max_num_seqs=1)
    engine.first_delay = 0.5
    async with serve(_app(engine, max_queued_requests=1)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.1)
        third = await http.post("/v1/chat/completions", json=CHAT)
        assert third.status_code == 503 and int(third.headers["retry-after"]) >= 1
        assert third.json()["error"]["code"] == "server_overloaded"
        assert (await running).status_code == 200 and (await waiting).status_code == 200


async def test_requests_in_prefill_are_not_queued(tokenizer_dir: Path) -> None:
    # NOTE: the scripted engine: its 16 seats run requests whose prefill (first_delay) takes
    # a second; the real tiny model's prefill steps are too short to hold a burst
    engine = FakeEngine(tokenizer_dir, max_num_seqs=16)
    engine.first_delay = 1.0
    async with serve(_app(engine, max_queued_requests=4)) as url, \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=80)) as http:
        replies = await asyncio.gather(*(http.post("/v1/chat/completions",
                                                   json={**CHAT, "max_tokens": 2})
                                         for _ in range(80)))
    codes = Counter(r.status_code for r in replies)
    assert codes == {200: 16 + 4, 503: 60}, codes  # the seats, then the queue bound


async def test_client_gone_while_sending_its_body_counts(fake_engine: FakeEngine) -> None:
    app = _app(fake_engine)
    async with serve(app) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"mo")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(100):
                text = (await http.get("/metrics")).text
                if "pagedserve_client_disconnects_total 1.0" in text:
                    break
                await asyncio.sleep(0.02)
        assert "pagedserve_client_disconnects_total 1.0" in text
        assert fake_engine.submitted == [] and app.state.gateway.generations == {}


async def test_final_event_carries_the_timeline(fake_engine: FakeEngine) -> None:
    counts = {"preemptions": 1, "recomputed_tokens": 3, "spec_draft_tokens": 4,
              "spec_accepted_tokens": 2}
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        reply = (await http.post("/v1/chat/completions", json=CHAT)).json()
        response = await http.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                            "max_tokens": 3})
        chunks = [json.loads(e[6:]) for e in (await _sse_events(response))[:-1]]
        stopped = (await http.post("/v1/chat/completions",
                                   json={**CHAT, "stop": ["how"]})).json()
    streamed = chunks[-1]["timeline"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("timeline" not in c for c in chunks[:-1])
    assert {c["object"] for c in chunks} == {"text_completion"}
    for timeline in (reply["timeline"], streamed):
        assert timeline["queued"] <= timeline["scheduled"] <= timeline["first_token"]
        assert timeline["first_token"] <= timeline["finished"]
        assert {k: timeline[k] for k in counts} == counts
        assert timeline["cached_tokens"] == 0
    # a stop string ends it in the gateway: the engine's counts are not known then
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["timeline"]["scheduled"] is not None
    assert all(stopped["timeline"][k] is None for k in counts)


async def test_api_key_and_health(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine, api_key="sekret")) as url, \
            httpx.AsyncClient(base_url=url) as http:
        denied = await http.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await http.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        # Anthropic's header, as a raw client sends it (its SDK sends a Bearer token)
        wrong_key = await http.get("/v1/models", headers={"x-api-key": "nope"})
        assert wrong_key.status_code == 401
        assert wrong_key.json()["error"]["code"] == "invalid_api_key"
        messages = {"model": "test-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}
        wrong_msg = await http.post("/v1/messages", json=messages, headers={"x-api-key": "nope"})
        assert wrong_msg.status_code == 401
        assert wrong_msg.json()["error"]["type"] == "authentication_error"
        assert (await http.get("/v1/models", headers={"x-api-key": "sekret"})).status_code == 200
        right_msg = await http.post("/v1/messages", json=messages,
                                    headers={"x-api-key": "sekret"})
        assert right_msg.status_code == 200 and right_msg.json()["type"] == "message"
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/livez")).status_code == 200
        assert (await http.get("/version")).json()["model"] == "test-model"
        missing = await http.get("/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_metrics_names(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/chat/completions", json=CHAT)
        text = (await http.get("/metrics")).text
    for name in (
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_inter_token_latency_seconds_bucket",
        "pagedserve_e2e_request_latency_seconds_bucket",
        "pagedserve_request_queue_time_seconds_bucket",
        "pagedserve_requests_running", "pagedserve_requests_waiting",
        "pagedserve_kv_cache_usage_ratio", "pagedserve_kv_blocks_free",
        "pagedserve_kv_blocks_total", "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total", "pagedserve_preemptions_total",
        "pagedserve_client_disconnects_total",
        'pagedserve_requests_total{finish_reason="stop"} 1.0',
    ):
        assert name in text, name


def _nested(depth: int) -> bytes:
    return b'{"model": "test-model", "unknown_field": ' + b"[" * depth + b"]" * depth + b"}"


BAD_INPUTS = [
    ("malformed", b'{"messages": [', 400, "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_json"),
    ("invalid utf-8", b'{"model": "\xff\xfe", "messages": []}', 400, "invalid_json"),
    ("deep nesting", _nested(50_000), 400, "invalid_json"),
    ("NaN", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "invalid_json"),
    ("infinite", json.dumps({**CHAT, "temperature": 1e999}).encode().replace(b"Infinity",
     b"1e999"), 400, "invalid_value"),
    ("negative max_tokens", json.dumps({**CHAT, "max_tokens": -1}).encode(), 400,
     "invalid_value"),
    ("huge int", json.dumps({**CHAT, "max_tokens": 10**30}).encode(), 400, "invalid_value"),
    ("temperature < 0", json.dumps({**CHAT, "temperature": -1}).encode(), 400, "invalid_value"),
    ("top_p > 1", json.dumps({**CHAT, "top_p": 2}).encode(), 400, "invalid_value"),
    ("n=65", json.dumps({**CHAT, "n": 65}).encode(), 400, "invalid_value"),
    ("missing messages", b'{"model": "test-model"}', 400, "missing_required_parameter"),
    ("empty messages", b'{"messages": []}', 400, "invalid_value"),
    ("wrong type", json.dumps({**CHAT, "stream": "yes"}).encode(), 400, "invalid_value"),
    ("unknown model", json.dumps({**CHAT, "model": "gpt-9"}).encode(), 404, "model_not_found"),
    # X-Request-Id echoes it (latin-1 only, no control characters) and the cancel URL names it
    ("request_id not ASCII", json.dumps({**CHAT, "request_id": "r\u5afd"}).encode(), 400,
     "invalid_value"),
    ("request_id with a slash", json.dumps({**CHAT, "request_id": "a/b"}).encode(), 400,
     "invalid_value"),
    ("context", json.dumps({**CHAT, "max_tokens": 10_000}).encode(), 400,
     "context_length_exceeded"),
    ("too large", b'{"x": "' + b"a" * 300_000 + b'"}', 413, "request_too_large"),
]


@pytest.mark.parametrize("name, body, status, code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_inputs(fake_engine: FakeEngine, name: str, body: bytes, status: int,
                          code: str) -> None:
    app = _app(fake_engine, max_body_bytes=256_000)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and isinstance(error["message"], str)
    assert set(error) == {"message", "type", "param", "code"}


async def test_a_bug_is_a_json_500(fake_engine: FakeEngine) -> None:
    def broken(msg: object) -> None:
        raise KeyError("a bug")

    fake_engine.submit = broken  # type: ignore[method-assign]
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"


async def test_no_ping_by_default(fake_engine: FakeEngine) -> None:
    fake_engine.first_delay = 0.3
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": "x", "stream": True, "max_tokens": 2}) as response:
            events = await _sse_events(response)
        assert all(e.startswith("data: ") for e in events)


def test_keepalive_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sse_keepalive_interval"):
        GatewaySettings(sse_keepalive_interval=0)


async def test_logprobs_limit_is_the_engines(fake_engine: FakeEngine) -> None:
    """`--max-logprobs` reaches the gateway through the engine's handshake (one limit)."""
    import msgspec

    fake_engine.info = msgspec.structs.replace(fake_engine.info, max_logprobs=30)
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        ok = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                      "logprobs": 30})
        assert ok.status_code == 200, ok.text
        too_many = await http.post("/v1/chat/completions", json={
            **CHAT, "logprobs": True, "top_logprobs": 31, "max_tokens": 1})
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "top_logprobs"


async def test_n_choices_json_and_sse(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await client.chat.completions.create(model="test-model",
                                                     messages=CHAT["messages"], n=3)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert all(c.message.content == REPLY for c in reply.choices)
        tokens = len(fake_engine.reply_ids)
        assert reply.usage.completion_tokens == 3 * tokens
        assert reply.usage.prompt_tokens == reply.usage.total_tokens - 3 * tokens
        stream = await client.completions.create(model="test-model", prompt="x", n=3,
                                                 stream=True, max_tokens=4,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        texts = {i: "".join(c.choices[0].text for c in chunks
                            if c.choices and c.choices[0].index == i) for i in range(3)}
        assert set(texts.values()) == {fake_engine.tokenizer.decode(fake_engine.reply_ids[:4])}
        finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
        assert sorted(finishes) == [0, 1, 2]
        assert chunks[-1].usage.completion_tokens == 12


async def test_best_of_keeps_the_most_likely(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        # the fake's choice i has cumulative logprob -(tokens) * (i + 1): 0 and 1 are best
        reply = (await http.post("/v1/completions", json={
            "prompt": "x", "n": 2, "best_of": 4, "max_tokens": 3})).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        assert fake_engine.submitted[-1].sampling.best_of == 4
        streamed = await http.post("/v1/completions", json={
            "prompt": "x", "n": 2, "best_of": 4, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"
        beam = await http.post("/v1/completions", json={
            "prompt": "x", "n": 2, "use_beam_search": True, "length_penalty": 0.5,
            "temperature": 0, "max_tokens": 2})
        assert beam.status_code == 200
        sampling = fake_engine.submitted[-1].sampling
        assert sampling.use_beam_search and sampling.length_penalty == 0.5 and sampling.n == 2


async def test_stop_string_on_one_choice_aborts_only_it(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        reply = (await http.post("/v1/chat/completions", json={
            **CHAT, "n": 2, "stop": [" how"]})).json()
    assert [c["message"]["content"] for c in reply["choices"]] == ["Hello there,"] * 2
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "stop"]
    rid = reply["id"]
    assert (rid, 0) in fake_engine.aborted_choices and rid in fake_engine.aborted


@pytest.mark.parametrize("field, value", [
    ("suffix", "end"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("bad_words", ["x"]), ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"), ("guided_choice", ["a", "b"])])


async def test_unimplemented_fields_are_refused(fake_engine: FakeEngine, field: str,
                                                value: object) -> None:
    from gateway.refused import REFUSED_FIELDS

    assert field in REFUSED_FIELDS
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="test-model", messages=CHAT["messages"],
                                                 extra_body={field: value})
        assert err.value.body["param"] == field and field in err.value.body["message"]
        if field.startswith("guided_"):
            assert "structured_outputs" in err.value.body["message"]
    assert fake_engine.submitted == []


async def test_no_op_fields_are_accepted(fake_engine: FakeEngine) -> None:
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await client.chat.completions.create(
            model="test-model", messages=CHAT["messages"], user="u", metadata={"k": "v"},
            store=False, service_tier="auto", extra_body={"tools": [], "response_format": None})
        assert reply.choices[0].message.content == REPLY


async def test_tokenize_and_detokenize(fake_engine: FakeEngine) -> None:
    tok = fake_engine.tokenizer
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        out = (await http.post("/tokenize", json={"prompt": "Hello world",
                                                 "return_token_strs": True})).json()
        assert out["tokens"] == tok.encode("Hello world") and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 256 and "".join(out["token_strs"]) == "Hello world"
        chat = (await http.post("/tokenize", json={
            "messages": CHAT["messages"], "add_generation_prompt": False})).json()
        assert chat["tokens"] == tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], False)
        back = (await http.post("/detokenize", json={"tokens": out["tokens"]})).json()
        assert back == {"prompt": "Hello world"}
        bad = await http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        missing = await http.post("/tokenize", json={"prompt": "x", "model": "other"})
        assert missing.status_code == 404


async def test_batched_prompts_and_echo(fake_engine: FakeEngine) -> None:
    tok = fake_engine.tokenizer
    three = tok.decode(fake_engine.reply_ids[:3])
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await client.completions.create(model="test-model", prompt=["A", "B"], n=2,
                                                max_tokens=3, echo=True)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert [c.text for c in reply.choices] == ["A" + three] * 2 + ["B" + three] * 2
        assert reply.usage.completion_tokens == 12
        ids = [tok.encode("A"), tok.encode("B")]
        stream = await client.completions.create(model="test-model", prompt=ids, max_tokens=3,
                                                 stream=True)
        chunks = [c async for c in stream]
        texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                 for i in range(2)]
        assert texts == [three, three]
        assert len({c.id for c in chunks}) == 1
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="test-model", prompt=["A", [1, 2]])
    prompts = [m.prompt_token_ids for m in fake_engine.submitted]
    assert prompts == [ids[0]] * 1 + [ids[1]] + ids


async def test_chat_extras(fake_engine: FakeEngine) -> None:
    tok = fake_engine.tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    async with serve(_app(fake_engine)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await client.chat.completions.create(
            model="test-model", messages=messages, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                        "echo": True, "chat_template_kwargs": {"unused_flag": True}})
    full = tok.render_chat(messages, False)
    cut = full[: full.rindex("Sure,") + len("Sure,")]
    assert fake_engine.submitted[-1].prompt_token_ids == tok.encode(cut)
    assert reply.choices[0].message.content == "Sure," + tok.decode(fake_engine.reply_ids[:2])


async def test_vllm_metric_names_beside_ours(fake_engine: FakeEngine) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        from ipc.messages import EngineStats

        fake_engine.stats = EngineStats(num_running=3, num_waiting=2, kv_blocks_total=64,
                                        kv_blocks_free=16, prefix_cache_queries=40,
                                        prefix_cache_hits=10)
        text = (await http.get("/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    model = (("model_name", "test-model"),)
    assert samples[("vllm:num_requests_running", model)] == 3
    assert samples[("vllm:num_requests_waiting", model)] == 2
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.75
    assert samples[("vllm:prefix_cache_queries_total", model)] == 40
    assert samples[("vllm:prefix_cache_hits_total", model)] == 10
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 2
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "length"), ("model_name", "test-model")))] == 2
    assert samples[("pagedserve_time_to_first_token_seconds_count", ())] == 2


async def test_cancel_a_batched_request_by_its_id(fake_engine: FakeEngine) -> None:
    fake_engine.first_delay = 60.0
    app = _app(fake_engine)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        call = asyncio.create_task(http.post("/v1/completions", json={
            "prompt": ["a", "b"], "request_id": "batch-1"}))
        while len(app.state.gateway.generations) < 2:
            await asyncio.sleep(0.01)
        assert (await http.post("/v1/requests/batch-1/cancel")).status_code == 200
        reply = (await call).json()
    assert reply["id"] == "batch-1"
    assert [c["finish_reason"] for c in reply["choices"]] == ["abort", "abort"]
    assert set(fake_engine.aborted) >= {"batch-1-0", "batch-1-1"}


async def test_chat_without_a_template_is_400_unless_one_is_given(tmp_path, tokenizer_dir):
    """A base model (no template in its tokenizer files) serves /v1/completions only, unless
    the gateway was started with --chat-template FILE."""
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    engine = FakeEngine(tmp_path)
    async with serve(_app(engine)) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "chat_template_missing"
        assert r.json()["error"]["param"] == "messages"
        r = await http.post("/v1/completions", json={"model": "test-model", "prompt": "hi"})
        assert r.status_code == 200
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    async with serve(_app(FakeEngine(tmp_path), chat_template=template)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY


async def test_a_wrong_method_is_an_invalid_request_error(fake_engine: FakeEngine) -> None:
    """OpenAI's error type for a client's mistake is `invalid_request_error`, 405 included."""
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.delete("/v1/chat/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"
