"""The gateway's OpenAPI 3.1 document, built from the msgspec types it decodes and encodes.

Served at `/openapi.json`; tests/gateway/test_openapi.py fuzzes the gateway against it.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Literal, get_args

import msgspec

from gateway.api.anthropic_errors import AnthropicError
from gateway.api.anthropic_types import (
    CountTokensRequest,
    MessageReply,
    MessagesRequest,
    StreamEvent,
    TokenCount,
)
from gateway.api.embeddings import EmbeddingRequest, EmbeddingResponse
from gateway.api.lora import LoadLoraRequest, UnloadLoraRequest
from gateway.api.model_management import openapi_paths as model_paths
from gateway.api.rerank import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from gateway.api.responses_types import (
    DeletedResponse,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
)
from gateway.errors import ErrorEnvelope
from gateway.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

REF = "#/components/schemas/{name}"
Schema = dict[str, Any]
# NOTE: /v1 checks a key only when the server has one (--api-key), hence "bearer or nothing".
BEARER: list[dict[str, list[str]]] = [{"bearerAuth": []}, {}]
# NOTE: the Anthropic routes take the key as `x-api-key` too (every /v1 route accepts both)
KEYED: list[dict[str, list[str]]] = [{"bearerAuth": []}, {"apiKeyHeader": []}, {}]


# Bodies the handlers write as plain dicts, described here.
class Health(msgspec.Struct):
    status: Literal["ok", "draining", "engine_unavailable"]


class Liveness(msgspec.Struct):
    status: Literal["alive"]


class VersionInfo(msgspec.Struct):
    version: str
    model: str | None  # None until the engine has said hello
    engine_incarnation: str | None


class Cancelled(msgspec.Struct):
    id: str
    object: Literal["request.cancelled"]
    cancelled: bool


class MessagesStreamEvent(msgspec.Struct):
    """Holder of the /v1/messages stream's event union, so it gets one component."""

    event: StreamEvent


class StreamCancelled(msgspec.Struct):
    id: str
    object: Literal["stream.cancelled"]
    cancelled: bool  # False: it had finished already


REQUESTS = (ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest,
            TokenizeChatRequest, DetokenizeRequest, ResponsesRequest, MessagesRequest,
            CountTokensRequest, EmbeddingRequest, RerankRequest, ScoreRequest,
            LoadLoraRequest, UnloadLoraRequest)
RESPONSES = (ChatCompletion, ChatCompletionChunk, Completion, ModelList, ErrorEnvelope, Health,
             Liveness, VersionInfo, Cancelled, ModelCard, TokenizeResponse, DetokenizeResponse,
             ResponseObject, ResponseEvent, DeletedResponse, MessageReply, TokenCount,
             AnthropicError, MessagesStreamEvent, StreamCancelled, EmbeddingResponse,
             RerankResponse, ScoreResponse)


def _structs(tp: Any, found: dict[str, type]) -> dict[str, type]:
    """Every Struct class in `tp`'s type tree, by name (as msgspec names the components)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if tp.__name__ in found:
            return found
        found[tp.__name__] = tp
        for field in msgspec.structs.fields(tp):
            _structs(field.type, found)
    for arg in get_args(tp):
        _structs(arg, found)
    return found


def _mark_sent_fields_required(components: dict[str, Schema]) -> None:
    """msgspec calls a field with a default optional, as it is when decoding; but a response
    struct encodes every field (unless omit_defaults), so clients may count on all of them."""
    requests: dict[str, type] = {}
    responses: dict[str, type] = {}
    for tp in REQUESTS:
        _structs(tp, requests)
    for tp in RESPONSES:
        _structs(tp, responses)
    for name, cls in responses.items():
        if name not in requests and not cls.__struct_config__.omit_defaults:
            fields = msgspec.structs.fields(cls)  # an UNSET field is left out while unset
            components[name]["required"] = [f.encode_name for f in fields
                                            if f.default is not msgspec.UNSET]


def _json(schema: Schema, description: str, headers: dict[str, Any] | None = None) -> Schema:
    out: Schema = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                               "required": True, "schema": {"type": "integer", "minimum": 1}}}
REQUEST_ID = {"X-Request-Id": {"description": "the request's id (cancel it by this id)",
                               "required": True, "schema": {"type": "string"}}}


EVENT_ID = {"type": "string", "description": "`<stream id>:<seq>` on a resumable stream"}


def _events(chunk: Schema) -> Schema:
    """One server-sent event: `data:` holds a chunk, a mid-stream error, or the final `[DONE]`.

    NOTE: OpenAPI 3.1 cannot describe the events of a stream (3.2 adds `itemSchema`); this
    `schema` describes each event, as Schemathesis reads a 3.1 text/event-stream schema.
    """
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [chunk, {"$ref": REF.format(name="ErrorEnvelope")}]}}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "if": {"const": "[DONE]"}, "else": payload},
        "event": {"type": "string"},
        "id": EVENT_ID,
    }}


ERRORS = {
    400: "invalid request (validation, context length, chat template)",
    401: "missing or wrong API key (only when the server has one)",
    404: "unknown model, route, running request, stored response or stream",
    410: "the stream can no longer be resumed (`stream_expired`)",
    413: "request body too large",
    500: "the engine failed this request (or the gateway has a bug)",
    503: "engine not ready, overloaded or draining",
}


_P = {"type": "object", "properties": {f"p{q}": {"type": ["number", "null"]}
                                       for q in (50, 90, 99)}}
_ENGINE = {"type": "object", "properties": {
    "engine": {"type": "string"}, "kv_cache_usage": {"type": "number"},
    "kv_blocks_used": {"type": "integer"}, "kv_blocks_total": {"type": "integer"},
    "running": {"type": "integer"}, "waiting": {"type": "integer"},
    "swapped": {"type": "integer"}, "preemptions": {"type": "integer"},
    "prefix_cache_hit_rate": {"type": ["number", "null"],
                              "description": "hits / lookups over the last interval"},
    "prefix_cache_hit_rate_total": {"type": ["number", "null"]},
    "prompt_tokens_per_s": {"type": "number"}, "generation_tokens_per_s": {"type": "number"}}}
STATS_SNAPSHOT = {"type": "object", "properties": {
    "seq": {"type": "integer"}, "time": {"type": "number", "description": "Unix seconds"},
    "interval_s": {"type": "number"}, "requests_in_flight": {"type": "integer"},
    "engines": {"type": "array", "items": _ENGINE},
    "ttft_seconds": _P, "itl_seconds": _P,
    "latency_window_s": {"type": ["number", "null"],
                         "description": "the percentiles cover requests of this many seconds"}}}


def _stats_events() -> Schema:
    """An event of the stats stream: a snapshot, or (event `history`) a list of them."""
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {
            "anyOf": [STATS_SNAPSHOT, {"type": "array", "items": STATS_SNAPSHOT}]}},
        "event": {"type": "string"}, "id": {"type": "string"}}}


def _errors(refs: dict[str, Schema], *statuses: int) -> dict[str, Schema]:
    return {str(s): _json(refs["ErrorEnvelope"], ERRORS[s], RETRY_AFTER if s == 503 else None)
            for s in statuses}


HI = [{"role": "user", "content": "Hello!"}]
CHAT_EXAMPLES = {
    "chat": {"value": {"messages": HI, "max_tokens": 16}},
    "stream": {"summary": "streamed, with logprobs and a final usage chunk", "value": {
        "messages": HI, "max_tokens": 16, "stream": True, "logprobs": True, "top_logprobs": 2,
        "stream_options": {"include_usage": True}}},
}
COMPLETION_EXAMPLES = {
    "text": {"value": {"prompt": "The capital of France is", "max_tokens": 8}},
    "stream": {"summary": "streamed, with logprobs and a final usage chunk", "value": {
        "prompt": "The capital of France is", "max_tokens": 8, "stream": True, "logprobs": 2,
        "stream_options": {"include_usage": True}}},
}


def _generate(refs: dict[str, Schema], operation_id: str, request: str, response: str,
              chunk: str, examples: dict[str, Schema]) -> Schema:
    ok: Schema = {
        "description": f"a {response}; with `stream: true`, server-sent events of "
                       f"{chunk} ending with `data: [DONE]`",
        "headers": REQUEST_ID,
        "content": {"application/json": {"schema": refs[response]},
                    "text/event-stream": {"schema": _events(refs[chunk])}},
    }
    return {"post": {
        "operationId": operation_id,
        "security": BEARER,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": refs[request], "examples": examples}}},
        "responses": {"200": ok, **_errors(refs, 400, 401, 404, 413, 500, 503)},
    }}


RESPONSE_EXAMPLES = {
    "text": {"value": {"input": "Hello!", "max_output_tokens": 16}},
    "stream": {"summary": "streamed events, with instructions", "value": {
        "input": [{"role": "user", "content": "Hello!"}], "instructions": "Be brief.",
        "max_output_tokens": 16, "stream": True}},
}


def _responses(refs: dict[str, Schema]) -> dict[str, Schema]:
    """POST /v1/responses and GET / DELETE /v1/responses/{response_id}."""
    # NOTE: each event is `event: <type>` and `data: <JSON of that event>`; no [DONE]
    event = {"type": "object", "required": ["data", "event"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": refs["ResponseEvent"]},
        "event": {"type": "string"}, "id": EVENT_ID}}
    ok = {"description": "a response; with `stream: true`, server-sent events from "
                         "response.created to one of response.completed / .incomplete / .failed",
          "headers": REQUEST_ID,
          "content": {"application/json": {"schema": refs["ResponseObject"]},
                      "text/event-stream": {"schema": event}}}
    path = [{"name": "response_id", "in": "path", "required": True,
             "schema": {"type": "string", "minLength": 1}}]

    def stored(operation_id: str, schema: Schema, what: str) -> Schema:
        return {"operationId": operation_id, "security": BEARER, "parameters": path,
                "responses": {"200": _json(schema, what), **_errors(refs, 401, 404)}}

    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse", "security": BEARER,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs["ResponsesRequest"], "examples": RESPONSE_EXAMPLES}}},
            "responses": {"200": ok, **_errors(refs, 400, 401, 404, 413, 500, 503)}}},
        "/v1/responses/{response_id}": {
            "get": stored("retrieveResponse", refs["ResponseObject"], "a stored response"),
            "delete": stored("deleteResponse", refs["DeletedResponse"], "it is deleted")},
    }
ANTHROPIC_ERRORS = {
    **{s: ERRORS[s] for s in (400, 401, 404, 413, 500)},
    529: "engine not ready, overloaded or draining (Anthropic's overloaded_error)",
}
MESSAGES_EXAMPLES = {
    "message": {"value": {"messages": HI, "max_tokens": 16}},
    "stream": {"summary": "streamed, with a system prompt", "value": {
        "system": "You are terse.", "messages": HI, "max_tokens": 16, "stream": True}},
}


def _anthropic_errors(refs: dict[str, Schema]) -> dict[str, Schema]:
    return {str(s): _json(refs["AnthropicError"], why, RETRY_AFTER if s == 529 else None)
            for s, why in ANTHROPIC_ERRORS.items()}


def _messages(refs: dict[str, Schema], components: dict[str, Schema]) -> dict[str, Schema]:
    """/v1/messages (JSON, or Anthropic's named SSE events) and its count_tokens."""
    events = components.pop("MessagesStreamEvent")["properties"]["event"]
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [events, refs["AnthropicError"]]}}
    stream = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"}, "data": {"type": "string", **payload}, "id": EVENT_ID}}
    ok = {"description": "a message; with `stream: true`, Anthropic's server-sent events "
                         "(message_start ... message_stop, or an `error` event)",
          "headers": REQUEST_ID,
          "content": {"application/json": {"schema": refs["MessageReply"]},
                      "text/event-stream": {"schema": stream}}}

    def post(operation_id: str, request: str, answer: Schema) -> Schema:
        return {"post": {
            "operationId": operation_id, "security": KEYED,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[request], "examples": MESSAGES_EXAMPLES}}},
            "responses": {"200": answer, **_anthropic_errors(refs)}}}

    return {"/v1/messages": post("createMessage", "MessagesRequest", ok),
            "/v1/messages/count_tokens": post(
                "countMessageTokens", "CountTokensRequest",
                _json(refs["TokenCount"], "the prompt's tokens, as /v1/messages renders it"))}


def _post(operation_id: str, body: Schema, ok: Schema, refs: dict[str, Schema],
          examples: dict[str, Schema]) -> Schema:
    """vLLM's tokenizer endpoints (outside /v1, so no API key)."""
    return {"post": {
        "operationId": operation_id,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": body, "examples": examples}}},
        "responses": {"200": ok, **_errors(refs, 400, 404, 413, 503)},
    }}


def _streams(refs: dict[str, Schema]) -> Schema:
    """Resume (GET) and cancel (DELETE) a resumable stream (docs/resume.md)."""
    path = {"name": "stream_id", "in": "path", "required": True,
            "schema": {"type": "string", "minLength": 1}}
    resume_from = [
        {"name": "Last-Event-ID", "in": "header", "required": False,
         "description": "`<stream id>:<seq>`: the events after that seq follow",
         "schema": {"type": "string"}},
        {"name": "after", "in": "query", "required": False,
         "description": "the last seq received (without Last-Event-ID); default -1",
         "schema": {"type": "integer"}},
    ]
    events = {"anyOf": [refs["ChatCompletionChunk"], refs["Completion"]]}
    return {
        "get": {"operationId": "resumeStream", "security": BEARER,
                "parameters": [path, *resume_from],
                "responses": {"200": {
                    "description": "the stream's events after that seq, then its live tail",
                    "headers": REQUEST_ID,
                    "content": {"text/event-stream": {"schema": _events(events)}}},
                    **_errors(refs, 400, 401, 404, 410)}},
        "delete": {"operationId": "cancelStream", "security": BEARER, "parameters": [path],
                   "responses": {"200": _json(refs["StreamCancelled"], "its generation was "
                                              "aborted (or had finished)"),
                                 **_errors(refs, 401, 404)}},
    }


RERANK_EXAMPLE = {"rerank": {"value": {"query": "What is paged attention?", "top_n": 2,
                                       "documents": ["KV cache in blocks", {"text": "A cat"}]}}}


def _pooling(refs: dict[str, Schema]) -> dict[str, Schema]:
    """/v1/embeddings, the rerank routes and the score routes (outside /v1: no key, as vLLM)."""
    def post(operation_id: str, request: str, response: str, what: str,
             examples: dict[str, Schema], keyed: bool) -> Schema:
        return {"post": {
            "operationId": operation_id, **({"security": BEARER} if keyed else {}),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[request], "examples": examples}}},
            "responses": {"200": _json(refs[response], what, REQUEST_ID),
                          **_errors(refs, 400, *((401,) if keyed else ()), 404, 413, 500, 503)}}}

    embed = {"texts": {"value": {"input": ["Hello world", "Paged attention"]}},
             "base64": {"value": {"input": "Hello", "encoding_format": "base64"}}}
    score = {"pairs": {"value": {"text_1": "What is paged attention?",
                                 "text_2": ["KV cache in blocks", "A cat"]}}}
    ranked = ("documents by relevance (a cross-encoder's score of each query/document pair, "
              "or the cosine of their embeddings), best first")
    paths = {"/v1/embeddings": post("createEmbedding", "EmbeddingRequest", "EmbeddingResponse",
                                    "one embedding per input, in order", embed, True)}
    for path, op in (("/v1/rerank", "rerank"), ("/rerank", "rerankUnversioned"),
                     ("/v2/rerank", "rerankV2")):
        paths[path] = post(op, "RerankRequest", "RerankResponse", ranked, RERANK_EXAMPLE,
                           path.startswith("/v1/"))
    for path, op in (("/score", "score"), ("/v1/score", "scoreV1")):
        paths[path] = post(op, "ScoreRequest", "ScoreResponse", "a score per pair", score,
                           path.startswith("/v1/"))
    return paths


def _lora(refs: dict[str, Schema]) -> Schema:
    """vLLM's run-time LoRA routes (gateway/api/lora.py): 404 unless run-time updating is on."""
    def post(operation_id: str, request: str, done: str, example: Schema) -> Schema:
        return {"post": {
            "operationId": operation_id, "security": BEARER,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[request], "examples": {"sql": {"value": example}}}}},
            "responses": {"200": {"description": done, "content": {"text/plain": {
                "schema": {"type": "string"}}}}, **_errors(refs, 400, 401, 404, 413, 503)}}}

    return {"/v1/load_lora_adapter": post(
                "loadLoraAdapter", "LoadLoraRequest", "loaded on every engine of its model",
                {"lora_name": "sql", "lora_path": "/adapters/sql"}),
            "/v1/unload_lora_adapter": post(
                "unloadLoraAdapter", "UnloadLoraRequest", "unloaded from every engine of its model",
                {"lora_name": "sql"})}


def _get(operation_id: str, responses: dict[str, Schema]) -> Schema:
    return {"get": {"operationId": operation_id, "responses": responses}}


def _model_paths(refs: dict[str, Schema]) -> dict[str, Schema]:
    """The served models, and tokenizing with the model's tokenizer."""
    return {
        "/v1/models": {"get": {
            "operationId": "listModels", "security": BEARER,
            "responses": {"200": _json(refs["ModelList"], "the served model"),
                          **_errors(refs, 401)}}},
        "/v1/models/{model_id}": {"get": {
            "operationId": "retrieveModel", "security": BEARER,
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "schema": {"type": "string", "minLength": 1}}],
            "responses": {"200": _json(refs["ModelCard"], "the model"),
                          **_errors(refs, 401, 404)}}},
        "/tokenize": _post("tokenize", {"anyOf": [refs["TokenizeCompletionRequest"],
                                                  refs["TokenizeChatRequest"]]},
                           _json(refs["TokenizeResponse"], "the prompt's token ids"), refs,
                           {"prompt": {"value": {"prompt": "Hello world"}},
                            "chat": {"value": {"messages": HI, "return_token_strs": True}}}),
        "/detokenize": _post("detokenize", refs["DetokenizeRequest"],
                             _json(refs["DetokenizeResponse"], "the ids' text"), refs,
                             {"ids": {"value": {"tokens": [19556, 905]}}}),
    }


def _generation_paths(refs: dict[str, Schema]) -> dict[str, Schema]:
    """Chat, completions and Responses, cancelling a request and resuming a stream."""
    cancel_path = {"name": "request_id", "in": "path", "required": True,
                   "schema": {"type": "string", "minLength": 1}}
    return {
        "/v1/chat/completions": _generate(refs, "createChatCompletion", "ChatCompletionRequest",
                                          "ChatCompletion", "ChatCompletionChunk", CHAT_EXAMPLES),
        "/v1/completions": _generate(refs, "createCompletion", "CompletionRequest", "Completion",
                                     "Completion", COMPLETION_EXAMPLES),
        **_responses(refs),
        "/v1/requests/{request_id}/cancel": {"post": {
            "operationId": "cancelRequest", "security": BEARER, "parameters": [cancel_path],
            "responses": {"200": _json(refs["Cancelled"], "the engine was told to abort it"),
                          **_errors(refs, 401, 404)}}},
        "/v1/streams/{stream_id}": _streams(refs),
    }


def _ops_paths(refs: dict[str, Schema]) -> dict[str, Schema]:
    """Health, liveness, version, metrics, the stats stream and this document."""
    return {
        "/health": _get("health", {
            "200": _json(refs["Health"], "ready"),
            "503": _json(refs["Health"], "engine not ready, or draining", RETRY_AFTER)}),
        "/livez": _get("livez", {"200": _json(refs["Liveness"], "the process is alive")}),
        "/version": _get("version", {"200": _json(refs["VersionInfo"], "versions")}),
        "/metrics": _get("metrics", {"200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}),
        "/v1/stats/stream": {"get": {
            "operationId": "streamStats", "security": BEARER,
            "responses": {"200": {
                "description": "server-sent events that never end: first `event: history` "
                               "(the kept snapshots, oldest first), then one snapshot a "
                               "second (`id:` its seq); the live view at /dashboard reads it",
                "content": {"text/event-stream": {"schema": _stats_events()}}},
                **_errors(refs, 401)}}},
        "/openapi.json": _get("openapi", {"200": _json({"type": "object"}, "this document")}),
        **_pooling(refs),
        **_lora(refs),
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once; callers must not mutate it)."""
    types = REQUESTS + RESPONSES
    refs_list, components = msgspec.json.schema_components(types, ref_template=REF)
    refs = {t.__name__: ref for t, ref in zip(types, refs_list, strict=True)}
    _mark_sent_fields_required(components)
    paths = {**_model_paths(refs), **_generation_paths(refs), **_ops_paths(refs),
             **_messages(refs, components), **model_paths(refs["ErrorEnvelope"])}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": package_version(),
                 "description": "OpenAI-compatible completions, chat completions, responses "
                                "and embeddings, rerank and score, and Anthropic Messages."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"},
                                "apiKeyHeader": {"type": "apiKey", "in": "header",
                                                 "name": "x-api-key"}},
        },
    }


def package_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"
