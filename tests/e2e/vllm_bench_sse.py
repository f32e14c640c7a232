"""How `vllm bench serve` reads a streamed completion (vllm/benchmarks/lib/
endpoint_request_func.py, `StreamedResponseHandler` and `async_request_openai_completions`),
rewritten here from its rules so tests can count requests the way that tool does:

- every network read is stripped of surrounding whitespace (and skipped when empty);
- the stripped reads are concatenated; a message is what precedes a blank line (`\\n\\n`);
- a leftover buffer that starts with `data: ` and holds `[DONE]` or valid JSON is a message;
- a message starting with `:` (an SSE comment) is skipped;
- any other message must be `data: <json>`; a parse error fails the request;
- a request succeeds only if some JSON message had non-empty `choices` (its first token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass


class BenchSseBuffer:
    def __init__(self) -> None:
        self.buffer = ""

    def add(self, read: str) -> list[str]:
        self.buffer += read
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if self.buffer.startswith("data: "):
            rest = self.buffer[len("data: "):].strip()
            if rest == "[DONE]" or (rest and _is_json(rest)):
                messages.append(self.buffer.strip())
                self.buffer = ""
        return messages


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass
class BenchResult:
    success: bool = False
    text: str = ""
    output_tokens: int | None = None
    error: str = ""


def count_stream(reads: Iterable[bytes]) -> BenchResult:
    """One request's outcome from the raw body reads of its streamed response."""
    result = BenchResult()
    buffer = BenchSseBuffer()
    first = False
    try:
        for raw in reads:
            read = raw.strip()
            if not read:
                continue
            for message in buffer.add(read.decode()):
                if message.startswith(":"):
                    continue
                payload = message.removeprefix("data: ")
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if choices := data.get("choices"):
                    first = True
                    result.text += choices[0].get("text") or ""
                elif usage := data.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.success = first
    if not first:
        result.error = "Never received a valid chunk to calculate TTFT."
    return result
