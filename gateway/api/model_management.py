"""llama.cpp router's model routes: `GET /models` (each model's state, engine PIDs and memory),
`POST /models/load` and `/models/unload`, allowed by --enable-model-management; and the cards
of `/v1/models` when the gateway serves several models.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.lora import adapter_cards
from gateway.body import read_body
from gateway.engine_client import EngineUnavailableError
from gateway.errors import ApiError
from gateway.model_registry import ModelRegistry, NameTakenError, ServedModel, UnknownModelError
from gateway.model_specs import ModelSpec, spec_of
from gateway.responses import ModelCard
from gateway.service import Gateway
from gateway.validate import decode_body


def model_cards(models: ModelRegistry) -> list[ModelCard]:
    """One card per served model, each followed by its adapters' (with `parent`)."""
    cards = []
    for name, m in models.models.items():
        max_len = m.engines.info.max_model_len if m.engines.info else None
        cards += [ModelCard(name, m.created, max_model_len=max_len),
                  *adapter_cards(m.loras, name, max_len)]
    return cards


class ModelRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        if gw.models is not None:
            gw.metrics.registry.register(_MemoryCollector(gw.models))

    async def list(self, request: Request) -> Response:
        try:
            models = self._registry()
        except ApiError as exc:
            return exc.response()
        rows = [_row(name, "loaded" if m.engines.ready else "loading", m)
                for name, m in models.models.items()]
        rows += [_row(name, state, None) for name, state in models.busy.items()
                 if name not in models.models]
        rows += [_row(name, "unloaded", None) for name in models.known
                 if name not in models.models and name not in models.busy]
        return JSONResponse({"object": "list", "data": rows})

    async def load(self, request: Request) -> Response:
        name = ""
        try:
            models = self._registry()
            self._check_allowed()
            name, options = await self._body(request)
            spec = self._spec(models, name, options)
            served = await models.load(spec)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=499)
        except EngineUnavailableError as exc:
            return ApiError(503, f"the model `{name}` did not start: {exc}",
                            "engine_unavailable", "model").response()
        except NameTakenError as exc:
            code = "model_already_loaded" if exc.param == "model" else "name_in_use"
            return ApiError(409, str(exc), code, exc.param).response()
        return JSONResponse({"success": True, "model": name, "pids": served.pids})

    async def unload(self, request: Request) -> Response:
        name = ""
        try:
            models = self._registry()
            self._check_allowed()
            name, options = await self._body(request)
            timeout = options.pop("timeout", 0)
            if options:
                raise ApiError(400, f"unknown field `{next(iter(options))}` (unload takes "
                               "`model` and `timeout`)", "invalid_value", next(iter(options)))
            if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0:
                raise ApiError(400, "`timeout` must be a number of seconds >= 0",
                               "invalid_value", "timeout")
            served = await models.unload(name, float(timeout))
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=499)
        except UnknownModelError:
            return ApiError(404, f"the model `{name}` is not loaded", "model_not_found",
                            "model").response()
        return JSONResponse({"success": True, "model": name, "pids": served.pids})

    def _registry(self) -> ModelRegistry:
        if self.gw.models is None:
            # NOTE: one model and no --enable-model-management: nothing here to manage
            raise ApiError(403, "model management is off: start the server with "
                           "--enable-model-management", "model_management_disabled")
        return self.gw.models

    def _check_allowed(self) -> None:
        if not self.gw.settings.model_management:
            raise ApiError(403, "loading and unloading models is off: start the server with "
                           "--enable-model-management", "model_management_disabled")
        if self.gw.draining:
            raise ApiError(503, "the server is shutting down", "server_draining")

    async def _body(self, request: Request) -> tuple[str, dict[str, Any]]:
        s = self.gw.settings
        options = decode_body(await read_body(request, s.max_body_bytes, s.body_timeout),
                              dict[str, Any])
        name = options.pop("model", None)
        if not isinstance(name, str) or not name.strip():
            raise ApiError(400, "`model` (the model's served name) is required",
                           "missing_required_parameter", "model")
        return name, options

    def _spec(self, models: ModelRegistry, name: str, options: dict[str, Any]) -> ModelSpec:
        """A known model's spec again (a reload), or a new one from the body's options."""
        known = models.known.get(name)
        if known is not None and not options:
            return known
        if known is None and "path" not in options:
            raise ApiError(404, f"the model `{name}` is not known: give its `path` (and "
                           "engine options) to load it", "model_not_found", "path")
        base = known.config if known is not None else models.base
        try:
            return spec_of(name, options, base, known.data_parallel_size if known else 1)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_value", _named_key(str(exc), options)) \
                from None


def _named_key(message: str, options: dict[str, Any]) -> str | None:
    """The option a spec error names (backquoted by spec_of, leading in EngineConfig's)."""
    return next((k for k in options if f"`{k}`" in message or message.startswith(k + " ")),
                None)


def _row(name: str, state: str, served: ServedModel | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "status": {"value": state},
            "pids": served.pids if served else [],
            "resident_bytes": served.resident_bytes() if served else 0,
            "data_parallel_size": served.spec.data_parallel_size if served else None}


class _MemoryCollector(Collector):
    """pagedserve_engine_resident_bytes{model_name}: what each model's engines hold now."""

    def __init__(self, models: ModelRegistry) -> None:
        self._models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pagedserve_engine_resident_bytes",
                                   "Resident memory of each model's engine processes",
                                   labels=["model_name"])
        for name, served in list(self._models.models.items()):
            family.add_metric([name], served.resident_bytes())
        yield family


def model_routes(gw: Gateway) -> list[Route]:
    routes = ModelRoutes(gw)
    return [Route("/models", routes.list, methods=["GET"]),
            Route("/models/load", routes.load, methods=["POST"]),
            Route("/models/unload", routes.unload, methods=["POST"])]



def openapi_paths(error: dict[str, Any]) -> dict[str, Any]:
    """The three routes' part of the OpenAPI document; `error` is the ErrorEnvelope's schema."""
    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": _ERRORS[c],
                         "content": {"application/json": {"schema": error}}} for c in codes}

    def answer(schema: dict[str, Any], what: str) -> dict[str, Any]:
        return {"description": what, "content": {"application/json": {"schema": schema}}}

    keyed = [{"bearerAuth": []}, {}]
    body = {"type": "object", "required": ["model"], "properties": {
        "model": {"type": "string", "description": "the served name"},
        "path": {"type": "string", "description": "HF directory or .gguf (load: a new model)"},
        "data_parallel_size": {"type": "integer", "minimum": 1},
        "lora_modules": {"type": "array", "description": "load: its LoRA adapters (with "
                         "enable_lora), each name=path or {name, path}", "items": {
                             "oneOf": [{"type": "string"}, {"type": "object", "properties": {
                                 "name": {"type": "string"}, "path": {"type": "string"}}}]}},
        "timeout": {"type": "number", "minimum": 0,
                    "description": "unload: seconds in-flight requests may finish"}},
        "additionalProperties": True}
    done = {"type": "object", "required": ["success", "model", "pids"], "properties": {
        "success": {"type": "boolean"}, "model": {"type": "string"},
        "pids": {"type": "array", "items": {"type": "integer"}}}}
    row = {"type": "object", "required": ["id", "status", "pids", "resident_bytes"],
           "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                          "status": {"type": "object", "properties": {"value": {
                              "enum": ["loaded", "loading", "unloading", "unloaded"]}}},
                          "pids": {"type": "array", "items": {"type": "integer"}},
                          "resident_bytes": {"type": "integer"},
                          "data_parallel_size": {"type": ["integer", "null"]}}}
    listing = {"type": "object", "properties": {"object": {"const": "list"},
                                                "data": {"type": "array", "items": row}}}

    def post(operation_id: str, what: str, examples: dict[str, Any],
             *codes: int) -> dict[str, Any]:
        return {"post": {"operationId": operation_id, "security": keyed,
                         "requestBody": {"required": True, "content": {
                             "application/json": {"schema": body, "examples": examples}}},
                         "responses": {"200": answer(done, what), **errors(*codes)}}}

    return {
        "/models": {"get": {"operationId": "listModelStates", "security": keyed,
                            "responses": {"200": answer(listing, "each model's state, engine "
                                                        "PIDs and resident memory"),
                                          **errors(401, 403)}}},
        "/models/load": post("loadModel", "its engines are ready and it is served", {
            "again": {"summary": "a model named at start, after an unload",
                      "value": {"model": "small"}},
            "new": {"summary": "a new model with its engine options", "value": {
                "model": "tiny", "path": "/models/tiny", "max_model_len": 2048}}},
            400, 401, 403, 404, 409, 413, 503),
        "/models/unload": post("unloadModel", "its requests ended and its engines exited", {
            "now": {"value": {"model": "small"}},
            "drain": {"summary": "its requests may finish for 5 s",
                      "value": {"model": "small", "timeout": 5}}},
            400, 401, 403, 404, 413, 503),
    }


_ERRORS = {
    400: "invalid options (the error names the field)",
    401: "missing or wrong API key (only when the server has one)",
    403: "model management is off (--enable-model-management)",
    404: "no such model (unload), or a new model without `path` (load)",
    409: "a model of that name is loaded, loading or unloading",
    413: "request body too large",
    503: "its engines did not start, or the server is draining",
}
