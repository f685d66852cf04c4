"""The server's LoRA adapters (vLLM's behaviour): registered at start, listed, loaded and unloaded.

    deepinfer serve MODEL --enable-lora --lora-modules sql=/adapters/sql '{"name": "chat", "path": ...}'

A request whose `model` is an adapter's name runs under it (ServerState.resolve_model) and its
response names the adapter. /v1/models lists each adapter beside the base model, `parent` being
the base model (or the adapter's base_model_name). With DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING (or
VLLM_ALLOW_RUNTIME_LORA_UPDATING) true, two more routes exist:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Without it they are 404s: loading makes the server read any directory a client names, which an
operator turns on knowingly. A load checks the adapter against the model before it is listed
(lora/registry.py) and answers 400 naming what is wrong; nothing changes then. Adapters live in
the front end only: each request carries its adapter to the engine core, which reads it into a
device slot when needed, so a restarted core serves them without being told again.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from deepinfer import envs
from deepinfer.entrypoints.errors import APIError, bad_request
from deepinfer.entrypoints.state import ServerState, get_state, read_json
from deepinfer.lora.adapter import LoRAAdapterError
from deepinfer.lora.config import LoRAConfig
from deepinfer.lora.modules import LoRAModule
from deepinfer.lora.registry import AdapterNameError, LoRARegistry
from deepinfer.types.lora import LoRARequest

logger = logging.getLogger(__name__)


def open_registry(state: ServerState, hf_config: dict, config: LoRAConfig, modules: list[LoRAModule]) -> None:
    """The server's adapters: --lora-modules checked and registered (a bad one stops the start,
    named), or none when --enable-lora is off (then --lora-modules is an error)."""
    if not config.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return
    state.loras = LoRARegistry(hf_config, config, reserved_names=tuple(state.served_model_names))
    for module in modules:
        try:
            lora = state.loras.add(module.name, module.path, module.base_model_name)
        except LoRAAdapterError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from None
        logger.info("LoRA adapter %r (id %d) served from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)


def adapter_card(state: ServerState, lora: LoRARequest, created: int) -> dict:
    """An adapter's /v1/models entry (the base model's fields; `root` names it, never its path)."""
    return {"id": lora.lora_name, "object": "model", "created": created, "owned_by": "deepinfer",
            "root": lora.lora_name, "parent": lora.base_model_name or state.model_name,
            "max_model_len": state.max_model_len}


def adapter_cards(state: ServerState, created: int) -> list[dict]:
    if state.loras is None:
        return []
    return [adapter_card(state, lora, created) for lora in list(state.loras.adapters.values())]


def _string_field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {type(value).__name__}", name)
    return value or None


def add_lora_routes(app: FastAPI) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter, when runtime updating is allowed."""
    if not envs.allow_runtime_lora_updating():
        return

    def registry(state: ServerState) -> LoRARegistry:
        if state.loras is None:
            raise bad_request("LoRA adapters are not served: start the server with --enable-lora")
        return state.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        state = get_state(request)
        body = await read_json(request)
        loras = registry(state)
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        if name is None or path is None:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                              "lora_name" if name is None else "lora_path")
        try:   # reads the adapter's files: off the event loop
            lora = await state.run_off_loop(loras.add, name, path, _string_field(body, "base_model_name"))
        except LoRAAdapterError as e:
            raise bad_request(str(e), "lora_name" if isinstance(e, AdapterNameError) else "lora_path") from None
        logger.info("LoRA adapter %r (id %d) loaded from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        state = get_state(request)
        body = await read_json(request)
        loras = registry(state)
        name = _string_field(body, "lora_name")
        if name is None:
            raise bad_request("'lora_name' must be provided.", "lora_name")
        try:
            loras.remove(name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
