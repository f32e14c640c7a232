"""LoRA adapters at the gateway (vLLM's routes and card shape): the registry that a request's
`model` resolves through, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (sent to every
engine of the pool), and the adapters' /v1/models cards with their `parent`."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.body import read_body
from gateway.errors import ApiError
from gateway.lora_registry import RUNTIME_ENV, LoraRegistry
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


class UnloadLoraRequest(msgspec.Struct, kw_only=True):
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed


def adapter_cards(registry: LoraRegistry, parent: str,
                  max_model_len: int | None) -> list[ModelCard]:
    """/v1/models cards of one pool's adapters (vLLM's shape: root is the adapter directory,
    parent the pool's base model)."""
    return [ModelCard(name, registry.created.get(name, 0), max_model_len=max_model_len,
                      root=path, parent=parent)
            for name, path in sorted(registry.paths.items())]


class LoraRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    async def load(self, request: Request) -> Response:
        try:
            body = await self._body(request, LoadLoraRequest)
            if body.lora_name in self.gw.loras.paths or body.lora_name == self.gw.model_name:
                raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been "
                               "loaded.", "invalid_value", "lora_name")
            msg = LoadLoraAdapter(request_id=_rid(), lora_name=body.lora_name,
                                  lora_path=body.lora_path)
            names = await self._ask(msg, "lora_path")
        except ApiError as exc:
            return exc.response()
        self.gw.loras.set(names, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            body = await self._body(request, UnloadLoraRequest)
            if body.lora_name not in self.gw.loras.paths:
                raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                               "model_not_found", "lora_name")
            names = await self._ask(UnloadLoraAdapter(request_id=_rid(),
                                                      lora_name=body.lora_name), "lora_name")
        except ApiError as exc:
            return exc.response()
        self.gw.loras.set(names, body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    async def _body(self, request: Request, kind: type):
        gw, registry = self.gw, self.gw.loras
        if not registry.runtime_updates:
            raise ApiError(404, "run-time LoRA loading is off: start the server with "
                           f"--allow-runtime-lora-updating or {RUNTIME_ENV}=True",
                           "runtime_lora_updating_disabled")
        if not registry.enabled:
            raise ApiError(400, "LoRA is off: start the server with --enable-lora",
                           "lora_disabled")
        body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout)
        parsed = decode_body(body, kind)
        gw.require_ready()
        return parsed

    async def _ask(self, msg: LoadLoraAdapter | UnloadLoraAdapter, param: str) -> list[str]:
        result = await self.gw.lora_request(msg, _ENGINE_TIMEOUT_S)
        if result.error is not None:
            raise ApiError(400, result.error, "invalid_value", param)
        return result.adapters


def _rid() -> str:
    return f"lora-{uuid.uuid4().hex}"
