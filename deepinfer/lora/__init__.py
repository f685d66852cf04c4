"""LoRA adapters (issue 46): PEFT adapters read into deepinfer's fused projections (adapter.py) and
the batched low-rank products that add them to a step's rows, each row with its own adapter or
none (ops.py)."""
