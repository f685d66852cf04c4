"""Which LoRA adapter a request runs under (vLLM's LoRARequest), as every layer passes it on.

    LoRARequest(lora_name, lora_int_id, lora_path)      # vLLM's positional order

The front end (LLM.generate's lora_request, or a server request whose `model` names an adapter)
attaches one to a request; it travels whole with the request to the engine core (AddRequest),
into the scheduler (Request: at most max_loras distinct adapters run at once), and to the runner
(NewRequestData), which reads the adapter from `lora_path` into a device slot when a request of
it first runs. So nothing has to be registered ahead in the core: a restarted core, or a second
data-parallel core, serves any adapter the moment a request of it arrives.

`lora_int_id` is the adapter's identity where weights are kept (the runner's slots and CPU copies)
and, with the name, in the prefix cache's keys: an adapter loaded again under the same name gets a
new id, so nothing computed under the old weights is ever taken for the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # The model the adapter was trained on, shown as its `parent` in /v1/models (vLLM's
    # --lora-modules JSON field); None: the served model.
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            # 0 is the base model's slot (lora/slots.py): an adapter never takes it.
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name the adapter's directory, got {self.lora_path!r}")

    # vLLM's shorter names for the same fields.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> str:
        """What the prefix cache's block hashes take of the adapter (types/block_hashes.extra_key):
        its name and id, so blocks computed under it are never another adapter's or the base's."""
        return lora_cache_key(self.lora_name, self.lora_int_id)


def lora_cache_key(lora_name: str, lora_int_id: int) -> str:
    """LoRARequest.cache_key from the two fields alone: the router rebuilds an adapter's block
    hashes from the (lora_name, lora_id) of a replica's KV events (router/kv_index.py), and must
    spell the key exactly as the engine does."""
    return f"lora:{lora_int_id}:{lora_name}"
