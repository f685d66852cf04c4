"""The runner's side of LoRA serving: which adapter is in which device slot, and each step's rows.

    lora = RunnerLoRA.for_config(model, config.lora)     # None when enable_lora is off
    lora.admit(plan.new_requests, runner.requests)       # after the plan's requests are applied
    rows = lora.step_rows(inputs.chunks, runner.requests, device)   # per-row slots, or None
    with step_rows(rows): model(...)                     # lora/slots.py

An adapter comes to the device when a request of it joins the runner (NewRequestData.lora): read
from its directory (or from the host copies kept of the last `cpu_loras` adapters read), checked
against the model's projections and max_lora_rank, and placed in a free slot, else in the least
recently used slot whose adapter no request held here uses. The scheduler keeps the adapters of
the running requests (which are exactly the requests held here) at most max_loras
(lora/scheduling.py), so such a slot always exists; the check below says so loudly if not.

Adapters are known by `lora_int_id` here: an adapter loaded again under its name gets a new id,
so a slot or host copy of the old weights is never taken for the new ones.

CUDA graphs (worker/cuda_graphs.py) read the per-row slots from a buffer of their own, which
`step_rows`' tensor is copied into before a replay; placing an adapter writes into the same slot
tensors in place (LoRASlots.place), on the step's stream, behind the steps queued before it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.lora.adapter import LoRAAdapter, load_adapter
from deepinfer.lora.config import LoRAConfig
from deepinfer.lora.slots import LoRASlots
from deepinfer.platforms.transfer import to_device
from deepinfer.types.lora import LoRARequest
from deepinfer.types.plan import NewRequestData

if TYPE_CHECKING:
    from deepinfer.worker.request_states import RunnerRequestState, StepChunk

logger = logging.getLogger(__name__)


class RunnerLoRA:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.slots = LoRASlots(model, config.max_loras, config.max_lora_rank)
        self.max_rank = config.max_lora_rank
        self.cpu_loras = config.cpu_loras
        self.slot_ids: list[int | None] = [None] * (config.max_loras + 1)   # slot -> lora_int_id; 0: the base
        self.slot_used: list[int] = [0] * (config.max_loras + 1)           # the step that last read a slot
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()           # read adapters, oldest first
        self.num_steps = 0
        self.num_reads = 0   # adapters read from their files (tests check that host copies are reused)

    @classmethod
    def for_config(cls, model: nn.Module, config: LoRAConfig) -> RunnerLoRA | None:
        return cls(model, config) if config.enable_lora else None

    def slot_of(self, lora: LoRARequest | None) -> int:
        """The slot a request's rows take: 0 for the base model. Its adapter must be resident."""
        if lora is None:
            return 0
        return self.slot_ids.index(lora.lora_int_id, 1)

    def admit(self, new_requests: Sequence[NewRequestData], held: Mapping[str, RunnerRequestState]) -> None:
        """Bring the adapters of the plan's new requests into slots. `held`: the runner's requests
        after the plan is applied (the new ones among them): their adapters stay where they are."""
        in_use = {state.lora.lora_int_id for state in held.values() if state.lora is not None}
        for new in new_requests:
            if new.lora is not None and new.lora.lora_int_id not in self.slot_ids[1:]:
                self._place(new.lora, in_use)

    def _place(self, lora: LoRARequest, in_use: set[int]) -> None:
        free = [s for s in range(1, len(self.slot_ids)) if self.slot_ids[s] is None]
        # Never a slot whose adapter a held request uses: its next step reads that slot.
        idle = [s for s in range(1, len(self.slot_ids)) if self.slot_ids[s] not in in_use]
        candidates = free or sorted(idle, key=lambda s: self.slot_used[s])
        if not candidates:
            raise RuntimeError(f"no LoRA slot for adapter {lora.lora_name!r}: all {len(self.slot_ids) - 1} hold "
                               "adapters of running requests (the scheduler admits at most max_loras)")
        slot = candidates[0]
        self.slots.place(slot, self._read(lora))
        self.slot_ids[slot] = lora.lora_int_id
        self.slot_used[slot] = self.num_steps

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's weights on the host: a kept copy, else read from its directory."""
        adapter = self.host.get(lora.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora.lora_name, lora.lora_path, self.max_rank, self.slots.layout)
        self.num_reads += 1
        self.host[lora.lora_int_id] = adapter
        while len(self.host) > self.cpu_loras:
            self.host.popitem(last=False)
        logger.info("LoRA adapter %r (id %d, rank %d) read from %s", lora.lora_name, lora.lora_int_id,
                    adapter.rank, lora.lora_path)
        return adapter

    def step_rows(self, chunks: Sequence[StepChunk], held: Mapping[str, RunnerRequestState],
                  device: torch.device) -> torch.Tensor | None:
        """Each row's slot for a step of `chunks` (in row order: a chunk's num_tokens rows are
        consecutive, as input_batch lays them out), on `device`; None when no row has an adapter
        (the projections then skip the products). Chunks of requests not held here (start-up
        and profiling steps) are base-model rows."""
        self.num_steps += 1
        slots = []
        for chunk in chunks:
            state = held.get(chunk.request_id)
            slots.append(self.slot_of(state.lora) if state is not None else 0)
        if not any(slots):
            return None
        for slot in set(slots):
            self.slot_used[slot] = self.num_steps
        rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.long),
                                       torch.tensor([c.num_tokens for c in chunks], dtype=torch.long))
        return to_device(rows, device)
