"""LoRA adapters (issue 46), vLLM-compatible: `LLM(enable_lora=True)` with
`generate(..., lora_request=LoRARequest(name, int_id, path))`, or `deepinfer serve --enable-lora
--lora-modules name=path` and requests whose `model` names an adapter.

    config.py      LoRAConfig: enable_lora, max_loras, max_lora_rank, max_cpu_loras
    registry.py    the front end's adapters by name: checked against the model before any request runs
    scheduling.py  at most max_loras distinct adapters among the running requests
    adapter.py     a PEFT adapter read into deepinfer's fused projections
    slots.py       the adapters resident on the device, and which one each row of a step takes
    manager.py     the runner's side: adapters read on demand, slots reused least recently used first
    ops.py         the batched low-rank products

Only the request type is imported here (it has no torch dependency): the rest is imported where used.
"""

from deepinfer.types.lora import LoRARequest

__all__ = ["LoRARequest"]
