"""POST /v1/embeddings (OpenAI's shape): each input becomes a prefill-only pooling request
(gateway/api/pooling.py, shared with rerank and score)."""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import Annotated, Literal

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.api.pooling import input_lists, pool, pooling_info, token_ids
from gateway.body import read_body
from gateway.errors import ApiError
from gateway.requests import Int32, PosInt, RequestId, TokenId
from gateway.service import Gateway
from gateway.streaming import DisconnectAwareResponse, json_response
from gateway.tracing import trace_headers
from gateway.validate import decode_body
from ipc.pooling import PoolingInfo, PoolingParams

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
Inputs = Annotated[list[str | TokenId | list[TokenId]], msgspec.Meta(max_length=MAX_INPUTS)]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # a text, a list of texts, a list of token ids, or a list of token-id lists
    input: str | Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PosInt | None = None  # Matryoshka truncation, where the model allows it
    user: str | None = None  # accepted (OpenAI's end-user id); not used
    # vLLM's extras
    add_special_tokens: bool = True  # as the checkpoint's tokenizer encodes (BOS/EOS)
    normalize: bool | None = None  # None: the model's (its sentence-transformers config)
    priority: Int32 = 0
    request_id: RequestId | None = None  # the id to cancel it by (and the response's id)


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
    created: int = 0


def check_dimensions(info: PoolingInfo, dimensions: int | None) -> None:
    if dimensions is None or info.allows(dimensions):
        return
    if not info.is_matryoshka:
        why = "does not support Matryoshka truncation (its config.json sets no " \
              "matryoshka_dimensions or is_matryoshka)"
    elif info.matryoshka_dimensions is not None:
        why = f"can be truncated to {list(info.matryoshka_dimensions)} only"
    else:
        why = f"has {info.dimensions} dimensions"
    raise ApiError(400, f"dimensions {dimensions}: this model ({info.dimensions} dimensions) "
                   f"{why}", "invalid_value", "dimensions")


def _check_embeds(info: PoolingInfo) -> None:
    # NOTE: as vLLM: a cross-encoder's pooled output is a score, not an embedding
    if info.num_labels is not None:
        raise ApiError(400, "this model is a cross-encoder (a sequence classifier): it scores "
                       "query/document pairs on /v1/rerank and /score and gives no "
                       "embeddings", "unsupported_model", "model")


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    floats = array.array("f", vector)  # float32, sent little-endian (as OpenAI's SDKs read)
    if sys.byteorder == "big":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode()


class EmbeddingsApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def create(self, request: Request) -> Response:
        gw = self.gw
        try:
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
            parsed = decode_body(body, EmbeddingRequest)
            gw = gw.for_model(parsed.model)  # NOTE: several models: that model's engines
            gw.require_ready()
            model = gw.check_model(parsed.model)
            info = pooling_info(gw)
            _check_embeds(info)
            check_dimensions(info, parsed.dimensions)
            items = input_lists(parsed.input, "input")
            prompts = await token_ids(gw, items, "input", parsed.add_special_tokens)
            ids = gw.pooling_ids(parsed.request_id, "embd", len(prompts))
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        pooling = PoolingParams(normalize=parsed.normalize, dimensions=parsed.dimensions)
        trace = trace_headers(request.headers)

        async def work() -> Response:
            try:
                vectors = await pool(gw, ids, "embedding", model, prompts, pooling,
                                     parsed.priority, trace)
            except ApiError as exc:
                return exc.response()
            tokens = sum(map(len, prompts))
            data = [Embedding(i, _encode(v, parsed.encoding_format))
                    for i, v in enumerate(vectors)]
            return json_response(EmbeddingResponse(
                ids[0], data, model, EmbeddingUsage(tokens, tokens), created=int(time.time())),
                {"X-Request-Id": ids[0]})

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)
