"""The Responses API (`/v1/responses`): its types and `client.responses` (create, stream,
retrieve, delete), sync and async."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import quote

import msgspec

from pagedserve_client._streaming import AsyncStream, Stream
from pagedserve_client._types import _Base

if TYPE_CHECKING:
    from pagedserve_client._client import AsyncClient, Client

# a text, or a list of input items (messages, function_call, function_call_output)
Input = str | list[dict[str, Any]]


class OutputContent(_Base):
    type: str = "output_text"
    text: str = ""


class OutputItem(_Base):
    """One item of `output`: a `message` (content of `output_text`), a `function_call`
    (call_id, name, arguments) or a `reasoning` item (content of `reasoning_text`)."""

    type: str
    id: str = ""
    status: str | None = None
    role: str | None = None
    content: list[OutputContent] = []
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class InputTokensDetails(_Base):
    cached_tokens: int = 0


class OutputTokensDetails(_Base):
    reasoning_tokens: int = 0


class ResponseUsage(_Base):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(_Base):
    reason: str | None = None


class ResponseError(_Base):
    code: str = ""
    message: str = ""


class Response(_Base):
    id: str
    status: str  # completed, incomplete, failed, cancelled (in_progress while streaming)
    model: str = ""
    created_at: int = 0
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    previous_response_id: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every message item, joined (as openai's `output_text`)."""
        return "".join(c.text for item in self.output if item.type == "message"
                       for c in item.content if c.type == "output_text")


class ResponseStreamEvent(_Base):
    """One streamed event: `type` says which fields it carries (OpenAI's event types)."""

    type: str
    sequence_number: int
    response: Response | None = None  # response.created / in_progress / completed / ...
    item: OutputItem | None = None  # response.output_item.added / .done
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    delta: str | None = None  # *.delta events
    text: str | None = None  # output_text.done / reasoning_text.done
    arguments: str | None = None  # function_call_arguments.done


class DeletedResponse(_Base):
    id: str
    deleted: bool = True


def _payload(input: Input, model: str | None, stream: bool, params: dict[str, Any]
             ) -> dict[str, Any]:
    return {"input": input, "model": model, "stream": stream, **params}


def _path(response_id: str) -> str:
    return f"/v1/responses/{quote(response_id, safe='')}"


class Responses:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, input: Input, model: str | None = ...,
               stream: Literal[False] = ..., **params: Any) -> Response: ...
    @overload
    def create(self, *, input: Input, model: str | None = ...,
               stream: Literal[True], **params: Any) -> Stream[ResponseStreamEvent]: ...
    def create(self, *, input: Input, model: str | None = None, stream: bool = False,
               **params: Any) -> Response | Stream[ResponseStreamEvent]:
        """POST /v1/responses; `params` are OpenAI's Responses fields (instructions, tools,
        tool_choice, text, previous_response_id, store, ...) and vLLM's sampling extras."""
        return self._client._create("/v1/responses", _payload(input, model, stream, params),
                                    Response, ResponseStreamEvent)

    def retrieve(self, response_id: str) -> Response:
        """GET a stored response (NotFoundError when it is not stored)."""
        response = self._client.request("GET", _path(response_id), None)
        return msgspec.json.decode(response.content, type=Response)

    def delete(self, response_id: str) -> DeletedResponse:
        response = self._client.request("DELETE", _path(response_id), None)
        return msgspec.json.decode(response.content, type=DeletedResponse)


class AsyncResponses:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, input: Input, model: str | None = ...,
                     stream: Literal[False] = ..., **params: Any) -> Response: ...
    @overload
    async def create(self, *, input: Input, model: str | None = ...,
                     stream: Literal[True], **params: Any) -> AsyncStream[ResponseStreamEvent]: ...
    async def create(self, *, input: Input, model: str | None = None, stream: bool = False,
                     **params: Any) -> Response | AsyncStream[ResponseStreamEvent]:
        return await self._client._create("/v1/responses", _payload(input, model, stream, params),
                                          Response, ResponseStreamEvent)

    async def retrieve(self, response_id: str) -> Response:
        response = await self._client.request("GET", _path(response_id), None)
        return msgspec.json.decode(response.content, type=Response)

    async def delete(self, response_id: str) -> DeletedResponse:
        response = await self._client.request("DELETE", _path(response_id), None)
        return msgspec.json.decode(response.content, type=DeletedResponse)
