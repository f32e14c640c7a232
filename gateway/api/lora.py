"""LoRA adapters at the gateway (vLLM's routes and card shape): POST /v1/load_lora_adapter
(vLLM's body, plus `base_model_name` to pick the model) and /v1/unload_lora_adapter, sent to
every engine of the adapter's parent model, and the adapters' /v1/models cards with `parent`."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.body import read_body
from gateway.errors import ApiError
from gateway.lora_registry import RUNTIME_ENV, LoraRegistry, runtime_updating_allowed
from gateway.responses import ModelCard
from gateway.validate import decode_body
from ipc.messages import LoadLoraAdapter, UnloadLoraAdapter

if TYPE_CHECKING:
    from gateway.service import Gateway

_ENGINE_TIMEOUT_S = 120.0  # reading an adapter is quick; an engine that never answers is not

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class LoadLoraRequest(msgspec.Struct, kw_only=True):
    lora_name: Name
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    # the served model it adapts: needed when several models' engines run with LoRA
    base_model_name: Name | None = None


class UnloadLoraRequest(msgspec.Struct, kw_only=True):
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed


def adapter_cards(registry: LoraRegistry, parent: str,
                  max_model_len: int | None) -> list[ModelCard]:
    """/v1/models cards of one model's adapters (vLLM's shape: root is the adapter directory,
    parent the base model)."""
    return [ModelCard(name, registry.created.get(name, 0), max_model_len=max_model_len,
                      root=path, parent=parent)
            for name, path in sorted(registry.paths.items())]


class LoraRoutes:
    """The two routes; with several models an adapter goes to its parent's engines only."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    async def load(self, request: Request) -> Response:
        try:
            body = await self._body(request, LoadLoraRequest)
            parent = self._parent_for_load(body.base_model_name)
            self._check_free(body.lora_name)
            msg = LoadLoraAdapter(request_id=_rid(), lora_name=body.lora_name,
                                  lora_path=body.lora_path)
            parent.loras.loading.add(body.lora_name)
            try:
                names = await self._ask(parent, msg, "lora_path")
            finally:
                parent.loras.loading.discard(body.lora_name)
        except ApiError as exc:
            return exc.response()
        parent.loras.set(names, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            body = await self._body(request, UnloadLoraRequest)
            parent = self._parent_of(body.lora_name)
            names = await self._ask(parent, UnloadLoraAdapter(
                request_id=_rid(), lora_name=body.lora_name), "lora_name")
        except ApiError as exc:
            return exc.response()
        parent.loras.set(names, body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    async def _body(self, request: Request, kind: type):
        gw = self.gw
        if not runtime_updating_allowed(gw.settings.allow_runtime_lora_updating):
            raise ApiError(404, "run-time LoRA loading is off: start the server with "
                           f"--allow-runtime-lora-updating or {RUNTIME_ENV}=True",
                           "runtime_lora_updating_disabled")
        if not self._adapted():
            raise ApiError(400, "LoRA is off: start the server with --enable-lora (or "
                           "enable_lora in a model's options)", "lora_disabled")
        body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
        parsed = decode_body(body, kind)
        gw.require_ready()
        return parsed

    def _adapted(self) -> list[str]:
        """The served models whose engines run with LoRA."""
        models = self.gw.models
        if models is None:
            return [self.gw.model_name or ""] if self.gw.loras.enabled else []
        return [name for name, m in models.models.items() if m.loras.enabled]

    def _parent_for_load(self, base_model_name: str | None) -> Gateway:
        """The gateway as the model a new adapter is for sees it (its engines, its adapters)."""
        adapted = self._adapted()
        if base_model_name is None:
            if len(adapted) > 1:
                raise ApiError(400, f"several models run with LoRA ({', '.join(adapted)}): "
                               "say in `base_model_name` which one the adapter is for",
                               "missing_required_parameter", "base_model_name")
            base_model_name = adapted[0]
        served = [self.gw.model_name] if self.gw.models is None else list(self.gw.models.models)
        if base_model_name not in served:
            raise ApiError(404, f"the model `{base_model_name}` is not served",
                           "model_not_found", "base_model_name")
        if base_model_name not in adapted:
            raise ApiError(400, f"the model `{base_model_name}` runs without LoRA (its "
                           "engines need enable_lora)", "lora_disabled", "base_model_name")
        parent = self.gw.for_model(base_model_name)
        parent.require_ready()
        return parent

    def _check_free(self, name: str) -> None:
        gw, models = self.gw, self.gw.models
        if models is None:
            is_model, held = name == gw.model_name, "an adapter" if gw.loras.holds(name) else None
        else:
            is_model, held = name in models.models or name in models.busy, models.holder(name)
        if is_model:
            raise ApiError(400, f"`{name}` is a model's name: an adapter needs one of its own",
                           "invalid_value", "lora_name")
        if held is not None:  # NOTE: vLLM's words, then whose adapter it is
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded ({held}).",
                           "invalid_value", "lora_name")

    def _parent_of(self, name: str) -> Gateway:
        """The gateway as the model serving adapter `name` sees it (404 if none does)."""
        models = self.gw.models
        known = self.gw.loras.holds(name) if models is None else \
            models.parent_of(name) is not None
        if not known:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                           "model_not_found", "lora_name")
        return self.gw.for_model(name)

    async def _ask(self, parent: Gateway, msg: LoadLoraAdapter | UnloadLoraAdapter,
                   param: str) -> list[str]:
        result = await parent.lora_request(msg, _ENGINE_TIMEOUT_S)
        if result.error is not None:
            raise ApiError(400, result.error, "invalid_value", param)
        return result.adapters


def _rid() -> str:
    return f"lora-{uuid.uuid4().hex}"
