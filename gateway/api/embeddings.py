"""POST /v1/embeddings (OpenAI's shape): each input becomes a prefill-only pooling request;
`embed_inputs` (token ids in, vectors out) is shared with rerank and score."""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
import uuid
from typing import Annotated, Literal

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.body import read_body
from gateway.errors import ApiError
from gateway.generation import RequestStreamLike
from gateway.requests import Int32, PosInt, TokenId
from gateway.service import Gateway
from gateway.streaming import DisconnectAwareResponse, json_response
from gateway.validate import decode_body
from ipc.messages import FINISH_ERROR, AddRequest
from ipc.pooling import PoolingInfo, PoolingParams
from ipc.sampling import SamplingParams

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


def pooling_info(gw: Gateway) -> PoolingInfo:
    """The engine's pooling (its handshake); 400 if this engine cannot embed."""
    info = gw.client.info
    if info is None or info.pooling is None:
        raise ApiError(400, "this server's engine does not run pooling requests",
                       "unsupported_model", "model")
    return info.pooling


def input_lists(value: str | list, param: str) -> list[str | list[int]]:
    """Each input of an OpenAI-style `input` (a text, texts, token ids, token-id lists)."""
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif value and all(isinstance(t, int) for t in value):
        items = [list(value)]
    elif len({type(v) for v in value}) > 1:
        raise ApiError(400, f"{param} must be a text, a list of texts, a list of token ids or "
                       "a list of token-id lists (not a mix)", "invalid_value", param)
    else:
        items = list(value)
    if not items:
        raise ApiError(400, f"{param} must not be empty", "invalid_value", param)
    for i, item in enumerate(items):
        if len(item) == 0:
            where = param if len(items) == 1 else f"{param}[{i}]"
            raise ApiError(400, f"{where} must not be empty", "invalid_value", where)
    return items


async def token_ids(gw: Gateway, items: list[str | list[int]], param: str,
                    add_special_tokens: bool = True) -> list[list[int]]:
    """Tokenize texts (token ids pass through) and check each against the engine's context:
    the one limits check (Gateway.encode_prompt) names the field."""
    max_model_len = gw.client.info.max_model_len  # type: ignore[union-attr]
    vocab = gw.tokenizer().vocab_size
    out = []
    for i, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{i}]"
        ids = (await gw.encode_prompt(item, add_special_tokens, where) if isinstance(item, str)
               else item)
        if not ids:
            raise ApiError(400, f"{where} has no tokens", "invalid_value", where)
        if max(ids) >= vocab:
            raise ApiError(400, f"token ids must be < {vocab}", "invalid_value", where)
        if len(ids) > max_model_len:
            raise ApiError(400, f"{where} has {len(ids)} tokens; this model's maximum context "
                           f"length is {max_model_len}", "context_length_exceeded", where)
        out.append(ids)
    return out


async def embed_inputs(gw: Gateway, prompts: list[list[int]], pooling: PoolingParams,
                       priority: int = 0, prefix: str = "embd") -> list[list[float]]:
    """One pooling request per prompt, all in flight at once; their vectors in order. A
    failure or cancellation (client gone) aborts the ones still running."""
    gw.require_ready()
    base = f"{prefix}-{uuid.uuid4().hex}"
    sampling = SamplingParams(max_tokens=None, pooling=pooling)
    streams = []
    try:
        for i, ids in enumerate(prompts):
            msg = AddRequest(request_id=f"{base}-{i}", prompt_token_ids=ids, sampling=sampling,
                             priority=priority, arrival_time=time.time())
            streams.append(gw.submit(msg))
        return list(await asyncio.gather(*(_vector(s) for s in streams)))
    finally:
        for stream in streams:
            await stream.aclose()  # NOTE: aborts in the engine unless it finished


async def _vector(stream: RequestStreamLike) -> list[float]:
    async for delta in stream:
        if delta.finish_reason == FINISH_ERROR:
            raise ApiError(500, delta.error or "the engine failed", "engine_error")
        if delta.finished:
            if delta.pooled is None:
                raise ApiError(500, f"the request ended ({delta.finish_reason}) without a "
                               "vector", "engine_error")
            return delta.pooled
    raise ApiError(500, "the engine ended the request without a result", "engine_error")


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
            check_dimensions(info, parsed.dimensions)
            items = input_lists(parsed.input, "input")
            prompts = await token_ids(gw, items, "input", parsed.add_special_tokens)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            gw.metrics.client_disconnects.inc()
            return Response(status_code=499)
        pooling = PoolingParams(normalize=parsed.normalize, dimensions=parsed.dimensions)

        async def work() -> Response:
            try:
                vectors = await embed_inputs(gw, prompts, pooling, parsed.priority)
            except ApiError as exc:
                return exc.response()
            tokens = sum(map(len, prompts))
            data = [Embedding(i, _encode(v, parsed.encoding_format))
                    for i, v in enumerate(vectors)]
            return json_response(EmbeddingResponse(
                f"embd-{uuid.uuid4().hex}", data, model, EmbeddingUsage(tokens, tokens),
                created=int(time.time())))

        return DisconnectAwareResponse(work, gw.metrics.client_disconnects.inc)
