"""POST /v1/rerank (+ /rerank, /v2/rerank: the Jina/Cohere shape vLLM serves) and /score
(+ /v1/score: vLLM's text_1/text_2 pairs). A cross-encoder (a sequence classifier) scores each
query/document pair, tokenized together; an embedding model scores the cosine between the
query's and each document's embedding, pooled as /v1/embeddings pools them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Annotated

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.embeddings import MAX_INPUTS
from gateway.api.pooling import input_lists, pair_ids, pool, pooling_info, token_ids
from gateway.body import read_body
from gateway.errors import ApiError
from gateway.requests import Int32, NonNegInt, RequestId
from gateway.service import Gateway
from gateway.streaming import DisconnectAwareResponse, json_response
from gateway.tracing import trace_headers
from gateway.validate import decode_body
from ipc.pooling import PoolingInfo, PoolingParams


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
    request_id: RequestId | None = None  # the id to cancel it by (and the response's id)


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
    request_id: RequestId | None = None  # the id to cancel it by (and the response's id)


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


Scorer = Callable[[list[list[float]]], list[float]]


async def scored_inputs(gw: Gateway, info: PoolingInfo, first: list[str], second: list[str],
                        pairs: list[tuple[int, int]], params: tuple[str, str]
                        ) -> tuple[list[list[int]], Scorer]:
    """The pooling requests' token ids, and what turns their vectors into each pair's score.
    A cross-encoder: one request per pair (first[i], second[j]), its score the pooled one; an
    embedding model: one per text, a pair's score the cosine of its two texts' vectors."""
    if info.num_labels is not None:
        prompts = await pair_ids(gw, [(first[i], second[j]) for i, j in pairs], params[1])
        return prompts, lambda vectors: [v[0] for v in vectors]
    prompts = (await token_ids(gw, input_lists(first, params[0]), params[0])
               + await token_ids(gw, input_lists(second, params[1]), params[1]))
    return prompts, lambda vectors: [cosine(vectors[i], vectors[len(first) + j])
                                     for i, j in pairs]


class RerankApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route(path, self.rerank, methods=["POST"])
                for path in ("/v1/rerank", "/rerank", "/v2/rerank")] + [
                Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")]

    async def _parse(self, request: Request, kind: type) -> tuple[object, str, Gateway,
                                                                  PoolingInfo]:
        """The body, the model's served name, the gateway as that model sees it and how
        that model pools."""
        gw = self.gw
        body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
        parsed = decode_body(body, kind)
        gw = gw.for_model(parsed.model)  # NOTE: several models: that model's engines
        gw.require_ready()
        model = gw.check_model(parsed.model)
        return parsed, model, gw, pooling_info(gw)

    async def rerank(self, request: Request) -> Response:
        gw = self.gw
        try:
            parsed, model, gw, info = await self._parse(request, RerankRequest)
            assert isinstance(parsed, RerankRequest)
            texts = [d if isinstance(d, str) else d.text for d in parsed.documents]
            if not parsed.documents:
                raise ApiError(400, "documents must not be empty", "invalid_value", "documents")
            input_lists(parsed.query, "query")  # NOTE: 400 for an empty query
            prompts, scorer = await scored_inputs(gw, info, [parsed.query], texts,
                                                  [(0, j) for j in range(len(texts))],
                                                  ("query", "documents"))
            ids = gw.pooling_ids(parsed.request_id, "rerank", len(prompts))
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        trace = trace_headers(request.headers)

        async def work() -> Response:
            try:
                scores = scorer(await pool(gw, ids, "rerank", model, prompts, PoolingParams(),
                                           parsed.priority, trace))
            except ApiError as exc:
                return exc.response()
            results = [RerankResult(i, score,
                                    TextDocument(texts[i]) if parsed.return_documents else None)
                       for i, score in enumerate(scores)]
            results.sort(key=lambda r: -r.relevance_score)
            tokens = sum(map(len, prompts))
            return json_response(RerankResponse(ids[0], model, results[: parsed.top_n or None],
                                                RerankUsage(tokens, tokens)),
                                 {"X-Request-Id": ids[0]})

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)

    async def score(self, request: Request) -> Response:
        gw = self.gw
        try:
            parsed, model, gw, info = await self._parse(request, ScoreRequest)
            assert isinstance(parsed, ScoreRequest)
            first, second = _texts(parsed.text_1, "text_1"), _texts(parsed.text_2, "text_2")
            pairs = score_pairs(len(first), len(second))
            prompts, scorer = await scored_inputs(gw, info, first, second, pairs,
                                                  ("text_1", "text_2"))
            ids = gw.pooling_ids(parsed.request_id, "score", len(prompts))
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        trace = trace_headers(request.headers)

        async def work() -> Response:
            try:
                scores = scorer(await pool(gw, ids, "score", model, prompts, PoolingParams(),
                                           parsed.priority, trace))
            except ApiError as exc:
                return exc.response()
            tokens = sum(map(len, prompts))
            return json_response(ScoreResponse(ids[0], model, [ScoreData(k, v) for k, v in
                                                                enumerate(scores)],
                                               RerankUsage(tokens, tokens),
                                               created=int(time.time())),
                                 {"X-Request-Id": ids[0]})

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = input_lists(value, param)  # NOTE: 400 for an empty list or text
    return [t for t in texts if isinstance(t, str)]
