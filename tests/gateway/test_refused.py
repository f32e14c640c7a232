"""Every refused request field, named in this file (not read from gateway/refused.py, so that
a field dropped from the table fails here), gets a 400 naming it over HTTP; empty values, which
clients send as defaults, still pass (for the guided_* fields only null: `{}` is a schema)."""

from __future__ import annotations

import httpx
import pytest
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "test-model", "prompt": "hi", "max_tokens": 2}

# field -> a value that asks for something
REFUSED = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "suffix": "end",
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= \"a\"",
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " *",
    "prediction": {"type": "content", "content": "Hello"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "bad_words": ["x"],
    "allowed_token_ids": [1, 2, 3],
    "truncate_prompt_tokens": 8,
    "prompt_embeds": "AAAA",
}
CHAT_ONLY = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
}
EMPTY = [None, [], {}, "", False]


def _app(engine: FakeEngine):
    return build_app(engine, GatewaySettings())  # type: ignore[arg-type]


def _assert_refused(reply: httpx.Response, field: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and f"`{field}`" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field", list(REFUSED))
async def test_each_refused_field_gets_a_400_naming_it(fake_engine: FakeEngine,
                                                       field: str) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        _assert_refused(await http.post("/v1/chat/completions",
                                        json={**CHAT, field: REFUSED[field]}), field)
        _assert_refused(await http.post("/v1/completions",
                                        json={**COMPLETION, field: REFUSED[field]}), field)
    assert fake_engine.submitted == []


@pytest.mark.parametrize("field", list(CHAT_ONLY))
async def test_tool_fields_are_refused_on_completions_only(fake_engine: FakeEngine,
                                                           field: str) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        _assert_refused(await http.post("/v1/completions",
                                        json={**COMPLETION, field: CHAT_ONLY[field]}), field)
        assert fake_engine.submitted == []
        body = {**CHAT, field: CHAT_ONLY[field]}
        if field != "tools":  # tool_choice and parallel_tool_calls need tools beside them
            body["tools"] = CHAT_ONLY["tools"]
        ok = await http.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field", [*REFUSED, *CHAT_ONLY])
async def test_empty_values_still_pass(fake_engine: FakeEngine, field: str) -> None:
    async with serve(_app(fake_engine)) as url, httpx.AsyncClient(base_url=url) as http:
        for value in EMPTY:
            completion = await http.post("/v1/completions", json={**COMPLETION, field: value})
            chat = await http.post("/v1/chat/completions", json={**CHAT, field: value})
            if field.startswith("guided_") and value is not None:
                # NOTE: only null asks for nothing here: `guided_json: {}` is a schema
                _assert_refused(completion, field)
                _assert_refused(chat, field)
                continue
            assert completion.status_code == 200, (value, completion.text)
            if field in REFUSED:
                assert chat.status_code == 200, (value, chat.text)
            elif chat.status_code != 200:
                # NOTE: the chat schema types the tool fields: a wrong type is a bad value there,
                # never an unsupported field
                assert chat.json()["error"]["code"] != "unsupported_parameter", (value, chat.text)
