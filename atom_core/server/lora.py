"""The server's LoRA adapters: the registry built from --lora-modules, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (vLLM's request shapes), and the /v1/models cards of the adapters.

A request picks an adapter by naming it as its `model`; `OpenAIServing.lookup_model` (serving.py) is
the one place a name becomes the base model or an adapter, for every endpoint."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from atom_core.config import EngineConfig
from atom_core.lora import LoRARegistry
from atom_core.server.protocol import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name alone picks the adapter here


def serving_loras(config: EngineConfig, model_name: str) -> LoRARegistry | None:
    """The adapters of --lora-modules, each checked against the base model (ValueError names a bad
    one); None without --enable-lora."""
    if not config.lora.enable_lora:
        return None
    from atom_core.loader import resolve_model_files

    hf_config = resolve_model_files(config.model.model, config.model.tokenizer).hf_config
    registry = LoRARegistry(config.lora.max_lora_rank, hf_config, reserved=(model_name,))
    for module in config.lora.modules:
        registry.add(*module)
    return registry


def adapter_cards(registry: LoRARegistry | None, base: dict) -> list[dict]:
    """/v1/models entries of the adapters: the base model's card with the adapter's id, its directory
    as root and as parent its --lora-modules base_model_name, else the base model (as vLLM lists them)."""
    if registry is None:
        return []
    return [base | {"id": r.lora_name, "root": r.lora_path, "parent": r.base_model_name or base["id"]}
            for r in registry.requests]


def lora_router(registry: LoRARegistry | None) -> APIRouter:
    router = APIRouter()

    def enabled() -> LoRARegistry:
        if registry is None:
            raise APIError("this server serves no LoRA adapters; start it with --enable-lora", 400)
        return registry

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        try:
            enabled().add(req.lora_name, req.lora_path)
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_path") from None
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        try:
            enabled().remove(req.lora_name)
        except KeyError as e:
            raise APIError(e.args[0], 404, "not_found_error", param="lora_name", code="lora_not_found") from None
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    return router
