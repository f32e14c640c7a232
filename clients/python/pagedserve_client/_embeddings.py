"""Embeddings, rerank and score: their types, `client.embeddings.create`, `client.rerank` and
`client.score` (sync and async). A base64 embedding is decoded to floats, as OpenAI's SDK does."""

from __future__ import annotations

import array
import base64
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from pagedserve_client._types import _Base

if TYPE_CHECKING:
    from pagedserve_client._client import AsyncClient, Client

# a text, texts, token ids or token-id lists
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
# a document to rerank: its text, or {"text": ...}
Document = str | dict[str, str]


class Embedding(_Base):
    index: int
    embedding: list[float]
    object: str = "embedding"


class EmbeddingUsage(_Base):
    prompt_tokens: int = 0
    total_tokens: int = 0


class CreateEmbeddingResponse(_Base):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage = msgspec.field(default_factory=EmbeddingUsage)
    id: str = ""
    object: str = "list"


class RerankDocument(_Base):
    text: str


class RerankResult(_Base):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(_Base):
    results: list[RerankResult]  # best first
    model: str
    usage: EmbeddingUsage = msgspec.field(default_factory=EmbeddingUsage)
    id: str = ""


class Score(_Base):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(_Base):
    data: list[Score]
    model: str
    usage: EmbeddingUsage = msgspec.field(default_factory=EmbeddingUsage)
    id: str = ""


def decode_embeddings(content: bytes) -> CreateEmbeddingResponse:
    raw = msgspec.json.decode(content)
    for item in raw.get("data", []):
        if isinstance(item.get("embedding"), str):
            floats = array.array("f")
            floats.frombytes(base64.b64decode(item["embedding"]))  # little-endian float32
            if sys.byteorder == "big":
                floats.byteswap()
            item["embedding"] = floats.tolist()
    return msgspec.convert(raw, CreateEmbeddingResponse)


def _embed_payload(input: EmbeddingInput, model: str | None, params: dict[str, Any]
                   ) -> dict[str, Any]:
    return {"input": input, "model": model, **params}


def _rerank_payload(query: str, documents: list[Document], model: str | None,
                    top_n: int | None, params: dict[str, Any]) -> dict[str, Any]:
    return {"query": query, "documents": documents, "model": model, "top_n": top_n, **params}


class Embeddings:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, input: EmbeddingInput, model: str | None = None,
               **params: Any) -> CreateEmbeddingResponse:
        """POST /v1/embeddings; `params`: encoding_format, dimensions, user, normalize, ..."""
        response = self._client.request("POST", "/v1/embeddings",
                                        _embed_payload(input, model, params))
        return decode_embeddings(response.content)


class AsyncEmbeddings:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, input: EmbeddingInput, model: str | None = None,
                     **params: Any) -> CreateEmbeddingResponse:
        response = await self._client.request("POST", "/v1/embeddings",
                                              _embed_payload(input, model, params))
        return decode_embeddings(response.content)


def rerank(client: Client, query: str, documents: list[Document], model: str | None,
           top_n: int | None, params: dict[str, Any]) -> RerankResponse:
    response = client.request("POST", "/v1/rerank",
                              _rerank_payload(query, documents, model, top_n, params))
    return msgspec.json.decode(response.content, type=RerankResponse)


async def async_rerank(client: AsyncClient, query: str, documents: list[Document],
                       model: str | None, top_n: int | None, params: dict[str, Any]
                       ) -> RerankResponse:
    response = await client.request("POST", "/v1/rerank",
                                    _rerank_payload(query, documents, model, top_n, params))
    return msgspec.json.decode(response.content, type=RerankResponse)


def score(client: Client, text_1: str | list[str], text_2: str | list[str],
          model: str | None) -> ScoreResponse:
    payload = {"text_1": text_1, "text_2": text_2, "model": model}
    return msgspec.json.decode(client.request("POST", "/v1/score", payload).content,
                               type=ScoreResponse)


async def async_score(client: AsyncClient, text_1: str | list[str], text_2: str | list[str],
                      model: str | None) -> ScoreResponse:
    payload = {"text_1": text_1, "text_2": text_2, "model": model}
    response = await client.request("POST", "/v1/score", payload)
    return msgspec.json.decode(response.content, type=ScoreResponse)
