"""POST /v1/rerank (+ /rerank, /v2/rerank: the Jina/Cohere shape vLLM serves) and /score
(+ /v1/score: vLLM's text_1/text_2 pairs). Relevance is a bi-encoder's: the cosine between
the query's and each document's embedding, pooled as /v1/embeddings pools them."""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.embeddings import (
    MAX_INPUTS,
    embed_inputs,
    input_lists,
    pooling_info,
    token_ids,
)
from gateway.body import read_body
from gateway.errors import ApiError
from gateway.requests import Int32, NonNegInt
from gateway.service import Gateway
from gateway.streaming import DisconnectAwareResponse, json_response
from gateway.validate import decode_body
from ipc.pooling import PoolingParams


class TextDocument(msgspec.Struct):
    text: str


Document = str | TextDocument


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Annotated[list[Document], msgspec.Meta(max_length=MAX_INPUTS)]
    model: str | None = None
    top_n: NonNegInt | None = None  # the best this many (None or 0: all, as vLLM)
    return_documents: bool = True
    priority: Int32 = 0


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: TextDocument | None = None


class RerankUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(msgspec.Struct, kw_only=True):
    # vLLM's: one text against each of the others (1 -> N), or pairwise (N <-> N)
    text_1: str | Annotated[list[str], msgspec.Meta(max_length=MAX_INPUTS)]
    text_2: str | Annotated[list[str], msgspec.Meta(max_length=MAX_INPUTS)]
    model: str | None = None
    priority: Int32 = 0


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    model: str
    data: list[ScoreData]
    usage: RerankUsage
    object: str = "list"
    created: int = 0


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_pairs(n1: int, n2: int) -> list[tuple[int, int]]:
    """vLLM's pairing of text_1 and text_2: 1 -> N, or N <-> N; 400 otherwise."""
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise ApiError(400, f"text_1 has {n1} texts and text_2 {n2}: give one text_1, or as many "
                   "as text_2", "invalid_value", "text_1")


class RerankApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route(path, self.rerank, methods=["POST"])
                for path in ("/v1/rerank", "/rerank", "/v2/rerank")] + [
                Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")]

    async def _parse(self, request: Request, kind: type) -> tuple[object, str, Gateway]:
        """The body, the model's served name and the gateway as that model sees it."""
        gw = self.gw
        body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
        parsed = decode_body(body, kind)
        gw = gw.for_model(parsed.model)  # NOTE: several models: that model's engines
        gw.require_ready()
        model = gw.check_model(parsed.model)
        pooling_info(gw)
        return parsed, model, gw

    async def rerank(self, request: Request) -> Response:
        gw = self.gw
        try:
            parsed, model, gw = await self._parse(request, RerankRequest)
            assert isinstance(parsed, RerankRequest)
            texts = [d if isinstance(d, str) else d.text for d in parsed.documents]
            if not parsed.documents:
                raise ApiError(400, "documents must not be empty", "invalid_value", "documents")
            query = await token_ids(gw, input_lists(parsed.query, "query"), "query")
            docs = await token_ids(gw, input_lists(texts, "documents"), "documents")
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)

        async def work() -> Response:
            try:
                vectors = await embed_inputs(gw, query + docs, PoolingParams(), parsed.priority,
                                             "rerank")
            except ApiError as exc:
                return exc.response()
            results = [RerankResult(i, cosine(vectors[0], v),
                                    TextDocument(texts[i]) if parsed.return_documents else None)
                       for i, v in enumerate(vectors[1:])]
            results.sort(key=lambda r: -r.relevance_score)
            tokens = sum(map(len, query + docs))
            return json_response(RerankResponse(f"rerank-{uuid.uuid4().hex}", model,
                                                results[: parsed.top_n or None],
                                                RerankUsage(tokens, tokens)))

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)

    async def score(self, request: Request) -> Response:
        gw = self.gw
        try:
            parsed, model, gw = await self._parse(request, ScoreRequest)
            assert isinstance(parsed, ScoreRequest)
            first = await token_ids(gw, input_lists(parsed.text_1, "text_1"), "text_1")
            second = await token_ids(gw, input_lists(parsed.text_2, "text_2"), "text_2")
            pairs = score_pairs(len(first), len(second))
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)

        async def work() -> Response:
            try:
                vectors = await embed_inputs(gw, first + second, PoolingParams(),
                                             parsed.priority, "score")
            except ApiError as exc:
                return exc.response()
            data = [ScoreData(k, cosine(vectors[i], vectors[len(first) + j]))
                    for k, (i, j) in enumerate(pairs)]
            tokens = sum(map(len, first + second))
            return json_response(ScoreResponse(f"score-{uuid.uuid4().hex}", model, data,
                                               RerankUsage(tokens, tokens),
                                               created=int(time.time())))

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)
