"""Pooling requests of /v1/embeddings, rerank and score: inputs to checked token ids (texts,
or a cross-encoder's text pairs), then one prefill-only Job per input, each a Generation in
the gateway's table (cancelled by the request's id, waited for by a drain), to its vector."""

from __future__ import annotations

import asyncio

from gateway.errors import ApiError
from gateway.generation import Generation, Job, ended_error
from gateway.service import Gateway
from ipc.messages import FINISH_ABORT, FINISH_ERROR
from ipc.pooling import PoolingInfo, PoolingParams
from ipc.sampling import SamplingParams


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


def _where(param: str, i: int, n: int) -> str:
    return param if n == 1 else f"{param}[{i}]"


async def token_ids(gw: Gateway, items: list[str | list[int]], param: str,
                    add_special_tokens: bool = True) -> list[list[int]]:
    """Tokenize texts (token ids pass through) and check each against the engine's context:
    the one limits check (Gateway.encode_prompt) names the field."""
    out = []
    for i, item in enumerate(items):
        where = _where(param, i, len(items))
        ids = (await gw.encode_prompt(item, add_special_tokens, where) if isinstance(item, str)
               else item)
        out.append(_checked(gw, ids, where))
    return out


async def pair_ids(gw: Gateway, pairs: list[tuple[str, str]], param: str) -> list[list[int]]:
    """A cross-encoder's inputs: each (first, second) text pair tokenized together, as
    sentence-transformers' CrossEncoder does; a pair too long names `param` (its i-th)."""
    out = []
    for i, (first, second) in enumerate(pairs):
        where = _where(param, i, len(pairs))
        out.append(_checked(gw, await gw.encode_pair(first, second, where), where))
    return out


def _checked(gw: Gateway, ids: list[int], where: str) -> list[int]:
    max_model_len = gw.client.info.max_model_len  # type: ignore[union-attr]
    vocab = gw.tokenizer().vocab_size
    if not ids:
        raise ApiError(400, f"{where} has no tokens", "invalid_value", where)
    if max(ids) >= vocab:
        raise ApiError(400, f"token ids must be < {vocab}", "invalid_value", where)
    if len(ids) > max_model_len:
        raise ApiError(400, f"{where} has {len(ids)} tokens; this model's maximum context "
                       f"length is {max_model_len}", "context_length_exceeded", where)
    return ids


async def pool(gw: Gateway, ids: tuple[str, list[str]], kind: str, model: str,
               prompts: list[list[int]], pooling: PoolingParams, priority: int = 0,
               trace: dict[str, str] | None = None) -> list[list[float]]:
    """One pooling request per prompt, all in flight at once and in the gateway's table
    (ids: the request's and its engine requests', from Gateway.pooling_ids); their vectors
    in order. A failure, a cancel (the cancel route, a drain's deadline: 500 `cancelled`) or
    the client leaving ends the ones still running."""
    sampling = SamplingParams(max_tokens=None, pooling=pooling)
    base, request_ids = ids
    response_id = base if len(request_ids) > 1 else None
    gens: list[Generation] = []
    tasks: list[asyncio.Future[list[float]]] = []
    try:
        for rid, ids in zip(request_ids, prompts, strict=True):
            gens.append(gw.start(Job(request_id=rid, kind=kind, model=model, prompt_ids=ids,
                                     sampling=sampling, priority=priority,
                                     response_id=response_id, trace_headers=trace or {})))
        tasks = [asyncio.ensure_future(_vector(g)) for g in gens]
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()  # NOTE: aborts in the engine unless it finished
            gw.finished(gen)


async def _vector(gen: Generation) -> list[float]:
    async for piece in gen:
        if piece is None or piece.finish_reason is None:
            continue
        if piece.finish_reason in (FINISH_ERROR, FINISH_ABORT):
            raise ended_error(piece)
        if piece.pooled is None:
            raise ApiError(500, f"the request ended ({piece.finish_reason}) without a vector",
                           "engine_error")
        return piece.pooled
    raise ApiError(500, "the engine ended the request without a result", "engine_error")
