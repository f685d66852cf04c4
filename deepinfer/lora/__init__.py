"""LoRA adapters (issue 46): PEFT adapters read into deepinfer's fused projections (adapter.py),
resident in slots of per-projection stacks with each step's rows taking their own slot (slots.py),
and the batched low-rank products that add them (ops.py). The model level is here and tested
against PEFT; the engine does not route requests to adapters yet (no --enable-lora)."""
