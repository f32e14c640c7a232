"""Every text the chat template renders is counted against the prompt bound (issue 30): a
huge tool schema is refused by its count naming `tools`, a long one is rendered and tokenized
off the event loop, and neither stalls a concurrent stream (a real server on the tiny model)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import pytest
from ops_support import record_gaps
from tiny_server import running_server

pytestmark = pytest.mark.timeout(300)

CHAT = {"messages": [{"role": "user", "content": "Hello, who are you?"}]}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server() as base:
        yield base


def _tool(description: str, properties: int = 0) -> dict:
    schema = {"type": "object",
              "properties": {f"p{i}": {"type": "string", "description": f"field {i * 7919}"}
                             for i in range(properties)}}
    return {"type": "function",
            "function": {"name": "lookup", "description": description, "parameters": schema}}


async def test_huge_tools_do_not_stall_a_concurrent_stream(url: str) -> None:
    # NOTE: varied words, as a real text (a repeated phrase tokenizes much faster)
    words = " ".join(f"w{i * 7919 % 100_003}" for i in range(500_000))
    huge = {**CHAT, "tools": [_tool(words[:3_000_000])]}  # 3 MB of description
    wide = {**CHAT, "tools": [_tool("x", properties=60_000)]}  # 3 MB of schema, short strings
    long = {**CHAT, "tools": [_tool(words[:200_000])]}  # under the bound: rendered off the loop
    kwargs = {**CHAT, "chat_template_kwargs": {"notes": words[:3_000_000]}}
    assert all(len(json.dumps(b)) < 4 * 1024 * 1024 for b in (huge, wide, long, kwargs))
    stream_body = {**CHAT, "stream": True, "max_tokens": 600, "ignore_eos": True}
    gaps: list[float] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        reader = asyncio.create_task(record_gaps(client, stream_body, gaps, started))
        await asyncio.wait_for(started.wait(), 60)
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                         for body in (huge, wide, long, kwargs)))
        assert not reader.done(), "the stream must outlast the huge bodies"
        await reader
    errors = [r.json()["error"] for r in replies]
    assert all(r.status_code == 400 for r in replies), [r.text[:200] for r in replies]
    assert [(e["param"], e["code"]) for e in errors[:2]] == [("tools",
                                                               "context_length_exceeded")] * 2
    assert "(tools: 3000" in errors[0]["message"]
    # under the character bound, the long tool is rendered and tokenized, and its tokens
    # do not fit the 4096-token context
    assert errors[2]["code"] == "context_length_exceeded"
    assert errors[3]["param"] == "chat_template_kwargs"
    assert len(gaps) >= 300 and max(gaps) < 1.0, f"longest gap {max(gaps):.2f} s"


def test_tool_call_arguments_count_as_message_text(url: str) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "' + "y" * 400_000 + '"}'}}
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "done"}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    counted = int(re.search(r"has (\d+) characters", error["message"]).group(1))
    assert counted > 400_000  # the arguments are counted
