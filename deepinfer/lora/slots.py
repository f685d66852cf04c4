"""The adapters resident on the device, and which adapter each row of a step takes.

attach(model, max_loras, max_rank) gives every projection a LoRA may adapt (adapter.projection_layout)
a stack of slots (ops.py: slot 0 zeros, the base model; slots 1..max_loras adapters), each sized
for the largest rank, so an adapter of a smaller rank fills the first columns and leaves zeros.
LoRASlots.place / clear put an adapter in a slot or take it out, in place: CUDA graphs captured
over the stacks keep reading the same tensors.

With tensor parallelism each rank keeps its part of every adapter, as vLLM shards them: a
column-parallel projection (qkv, gate_up: output rows split) keeps A whole and its rows of B, part
by part; a row-parallel one (o, down: input columns split) keeps its columns of A and B whole, and
adds its rows' partial products before the projection's all-reduce, which sums them with the
base model's partial sums (the product is linear in x's columns: no collective of its own).

A step's rows take their adapters through `step_rows(slots)`: while the context is open, every
adapted projection adds its rows' LoRA products to its output (Linear.forward calls LoRAStack.add).
Without it (or for a model with no adapters attached) the projections compute as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.lora.adapter import LoRAAdapter, LoRAAdapterError, projection_layout
from deepinfer.lora.ops import lora_gathered, lora_masked, lora_reference

_step_slots: torch.Tensor | int | None = None   # the current step's slot per row (step_rows)
# On a GPU, steps of at most this many rows take the gathered path (ops.py), larger ones the
# masked path: the gathered copies of A and B grow with the rows (rows * R * (in + out) values a
# projection), the masked path's temporaries do not.
GATHERED_MAX_ROWS = 16


@contextlib.contextmanager
def step_rows(slots: torch.Tensor | int | None):
    """`slots` [rows] (int64, on the model's device): each row's adapter slot, 0 for none; an int:
    every row takes that slot; None: no row has an adapter (the projections skip the products)."""
    global _step_slots
    previous, _step_slots = _step_slots, slots
    try:
        yield
    finally:
        _step_slots = previous


@dataclass
class LoRAStack:
    a: torch.Tensor   # [slots, R, in]
    b: torch.Tensor   # [slots, out, R]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection's output for x) plus the LoRA products of x's rows under the step's
        slots (step_rows); y itself when no step has any (Linear.forward's hook)."""
        slots = _step_slots
        if slots is None:
            return y
        if isinstance(slots, int):
            slots = torch.full(x.shape[:-1], slots, dtype=torch.long, device=x.device).reshape(-1)
        return y + self.delta(x, slots).to(y.dtype)

    def delta(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows' LoRA products: on a GPU by a path without host syncs (fits a CUDA graph, and
        never stalls a step queued ahead), gathered for a few rows and masked for more; on the
        host one product per adapter present."""
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_cuda:
            product = lora_reference
        else:
            product = lora_gathered if flat.shape[0] <= GATHERED_MAX_ROWS else lora_masked
        return product(flat, slots, self.a, self.b).view(*x.shape[:-1], -1)


class LoRASlots:
    """Every adapted projection's stack of max_loras + 1 slots, and which adapter is in which."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.layout = projection_layout(model)   # whole: what adapters are read against
        if not self.layout:
            raise LoRAAdapterError(f"{type(model).__name__} has no projection a LoRA adapter may adapt")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.names: list[str | None] = [None] * (max_loras + 1)   # slot -> adapter name; slot 0 the base
        self.modules = dict(model.named_modules())
        self.stacks: dict[str, LoRAStack] = {}
        for name, (_, widths) in self.layout.items():
            module = self.modules[name]
            weight = module.weight
            dtype = weight.dtype if weight.is_floating_point() and weight.element_size() > 1 else torch.bfloat16
            rank = len(widths) * max_rank
            # Sized as this rank's slice of the projection (its in_features and out_features).
            stack = LoRAStack(
                torch.zeros(max_loras + 1, rank, module.in_features, dtype=dtype, device=weight.device),
                torch.zeros(max_loras + 1, module.out_features, rank, dtype=dtype, device=weight.device))
            module.lora = stack
            self.stacks[name] = stack
        for module in model.modules():   # layer plans that call the projections' matmuls directly
            if hasattr(module, "forget_layer_plans"):
                module.forget_layer_plans()

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names[1:] else None

    def free_slot(self) -> int | None:
        return next((s for s in range(1, self.max_loras + 1) if self.names[s] is None), None)

    @torch.no_grad()
    def place(self, slot: int, adapter: LoRAAdapter) -> None:
        """Adapter `adapter` into `slot` (1..max_loras), replacing whatever was there."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.max_loras}")
        self.clear(slot)
        for name, (a, b) in adapter.weights.items():
            stack = self.stacks[name]
            a, b = rank_part(self.modules[name], a, b)
            width = a.shape[0]   # shards * the adapter's rank: the first columns of the slot
            stack.a[slot, :width] = a.to(stack.a.dtype)
            stack.b[slot, :, :width] = b.to(stack.b.dtype)
        self.names[slot] = adapter.name

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for stack in self.stacks.values():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
        self.names[slot] = None


def rank_part(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of a whole fused adapter pair (adapter.fuse) of `module`
    (the module docstring); the pair itself on one rank or for a projection that is not split."""
    from deepinfer.layers.parallel import ColumnParallelLinear, RowParallelLinear

    group = getattr(module, "group", None)
    if group is None or group.size == 1:
        return a, b
    if isinstance(module, ColumnParallelLinear):
        # B is block-diagonal over the fused parts: each part's rows cut as the weight's are.
        starts = [sum(module.full_sizes[:i]) for i in range(len(module.full_sizes))]
        return a, torch.cat([module.rank_part(b[start:start + size], i)
                             for i, (start, size) in enumerate(zip(starts, module.full_sizes))])
    if isinstance(module, RowParallelLinear):
        return module.rank_part(a), b
    return a, b
