"""The front end's LoRA adapters: what a request may name, each checked before any request of it runs.

    registry = LoRARegistry(hf_config, config.lora)
    lora = registry.add("sql", "/adapters/sql")        # the server: --lora-modules, /v1/load_lora_adapter
    registry.get("sql")                                # a request whose `model` is "sql"
    registry.checked(LoRARequest("sql", 1, path))      # LLM.generate(lora_request=...)

Checking reads the adapter exactly as the runner will (adapter.load_adapter: its config, every
tensor's name and shape) against the model's adaptable projections, laid out from a copy of the
model built on the meta device (no memory, no weights). So a bad adapter (a missing directory, a
rank above max_lora_rank, a module the model lacks, an option PEFT computes differently) is refused
here with LoRAAdapterError naming the field and the limit, before anything reaches the engine, and
never fails a step. (The runner reads the files again when it needs the weights; an adapter whose
files change or vanish after the check is the one thing that can still fail there.)

The server numbers its adapters 1, 2, ... in the order they are added (vLLM's lora_int_id): two
servers started with the same --lora-modules give them the same ids, so a KV store shared between
them (whose keys hold the id: LoRARequest.cache_key) serves both.
"""

from __future__ import annotations

import itertools
import os
import threading

from deepinfer.lora.adapter import LoRAAdapterError, load_adapter, projection_layout
from deepinfer.lora.config import LoRAConfig
from deepinfer.types.lora import LoRARequest


class AdapterNameError(LoRAAdapterError):
    """The name is what is wrong (taken, or not a name), not the adapter's files."""


class LoRARegistry:
    def __init__(self, hf_config: dict, config: LoRAConfig, reserved_names: tuple[str, ...] = ()) -> None:
        """`reserved_names`: names an adapter may not take (the served model's own)."""
        self.hf_config = hf_config
        self.config = config
        self.reserved_names = set(reserved_names)
        self.adapters: dict[str, LoRARequest] = {}      # by name, in the order added
        self._next_id = itertools.count(1)
        self._checked: dict[int, LoRARequest] = {}      # LLM's adapters, by lora_int_id
        self._layout: dict[str, tuple[int, list[int]]] | None = None
        # Adding runs in worker threads (a server's load route): a name is reserved under the
        # lock, checked outside it (reading files takes time), then published or released.
        self._lock = threading.Lock()
        self._pending: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    def layout(self) -> dict[str, tuple[int, list[int]]]:
        """The model's adaptable projections (adapter.projection_layout), from a meta-device copy."""
        if self._layout is None:
            import torch

            from deepinfer.models.registry import model_class

            with torch.device("meta"):
                model = model_class(self.hf_config).build(self.hf_config, "auto", True)
            self._layout = projection_layout(model)
            if not self._layout:
                raise LoRAAdapterError(f"{type(model).__name__} has no projection a LoRA adapter may adapt")
        return self._layout

    def check(self, lora: LoRARequest) -> None:
        """LoRAAdapterError unless the runner can serve `lora` (see the module docstring)."""
        if not self.enabled:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: LoRA is not enabled; start the engine with "
                                   "enable_lora=True (--enable-lora)")
        if not os.path.isdir(lora.lora_path):
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: lora_path {lora.lora_path!r} is not a "
                                   "directory (a PEFT adapter directory holds adapter_config.json and "
                                   "adapter_model.safetensors)")
        load_adapter(lora.lora_name, lora.lora_path, self.config.max_lora_rank, self.layout())

    # ------------------------------------------------------------------------- the server's
    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register the adapter at `path` as `name`, with the next id."""
        if not isinstance(name, str) or not name:
            raise AdapterNameError(f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise LoRAAdapterError(f"lora_path must be a non-empty string, got {path!r}")
        with self._lock:
            if name in self.reserved_names:
                raise AdapterNameError(f"lora_name {name!r} is the served model's name; give the adapter another")
            if name in self.adapters or name in self._pending:
                raise AdapterNameError(f"The lora adapter '{name}' has already been loaded.")
            self._pending.add(name)
        try:
            lora = LoRARequest(name, next(self._next_id), path, base_model_name)
            self.check(lora)
            with self._lock:
                self.adapters[name] = lora
            return lora
        finally:
            with self._lock:
                self._pending.discard(name)

    def remove(self, name: str) -> LoRARequest:
        """Forget the adapter `name` (KeyError: none of that name). Requests of it already in the
        engine finish under it; its weights leave the device when their slot is next needed."""
        with self._lock:
            return self.adapters.pop(name)

    # ------------------------------------------------------------------------- LLM's
    def checked(self, lora: LoRARequest) -> LoRARequest:
        """`lora` once checked (the first request of each lora_int_id reads its files). One id
        names one adapter: the same id with another name or path is refused, as it would mix
        slots and cached KV of two adapters."""
        known = self._checked.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} "
                                       f"({known.lora_path}); give {lora.lora_name!r} ({lora.lora_path}) an id of "
                                       "its own")
            return known
        self.check(lora)
        self._checked[lora.lora_int_id] = lora
        return lora
