"""The runner's per-request state, kept in step with the scheduler by applying each plan.

A request arrives whole once (NewRequestData) and then as diffs (CachedRequestData, see
types/plan.py): `update_states` applies a plan's finished ids, new requests and diffs, in that
order. `step_chunks` then pairs each scheduled chunk with its request's block tables, which is
what the step's inputs are built from (worker/input_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_tables import apply_block_table_diffs
from deepinfer.types.lora import LoRARequest
from deepinfer.types.plan import CachedRequestData, NewRequestData, ScheduledChunk, SchedulerPlan
from deepinfer.worker.pooling import PoolingState


@dataclass
class RunnerRequestState:
    token_ids: list[int]          # prompt + sampled tokens, as far as the runner knows
    prompt_token_ids: list[int]
    output_token_ids: list[int]   # kept beside token_ids so the sampler gets them without a copy
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    block_ids: list[list[int]]    # one block table per layer group, this runner's own copy
    num_placeholders: int = 0     # trailing sampled tokens not collected yet (overlapped scheduling)
    # SWA Bounded Replay (NewRequestData): sliding-window layers see no key below window_floor,
    # full-attention layers write no K/V below write_floor. Both 0: a plain request.
    window_floor: int = 0
    write_floor: int = 0
    # What the model keeps per request between steps beside its KV pages (DeepSeek-V4: the
    # compressors' projections of the tokens of an unfinished block). Dropped with the state,
    # so a preempted request starts afresh from its KV.
    model_state: dict = field(default_factory=dict)
    pooling: PoolingState | None = None   # a pooling request's vector as its chunks run (worker/pooling.py)
    lora: LoRARequest | None = None       # the adapter its rows take (lora/manager.py); None: the base model

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> RunnerRequestState:
        generator = torch.Generator(device=device) if new.sampling_params.seed is not None else None
        # Copies: the plan is a value the runner reads, never changes (in one process the
        # scheduler's plan object is the very one received here).
        return cls(new.prompt_token_ids + new.output_token_ids, list(new.prompt_token_ids),
                   list(new.output_token_ids), new.sampling_params, new.eos_token_ids, generator,
                   [list(ids) for ids in new.block_ids], window_floor=new.window_floor,
                   write_floor=new.write_floor,
                   pooling=PoolingState(new.pooling, len(new.prompt_token_ids)) if new.pooling is not None else None,
                   lora=new.lora)

    def apply(self, cached: CachedRequestData) -> None:
        if cached.block_table_diffs is not None:
            apply_block_table_diffs(self.block_ids, cached.block_table_diffs)
        if cached.num_dropped_tokens or cached.new_token_ids:
            # Only a runner that samples drafts for another model gets these, between steps.
            assert self.num_placeholders == 0, "token diff while a sampled token is in flight"
            assert cached.num_dropped_tokens <= len(self.output_token_ids), "dropping prompt tokens"
            if cached.num_dropped_tokens:
                del self.token_ids[-cached.num_dropped_tokens:]
                del self.output_token_ids[-cached.num_dropped_tokens:]
            self.token_ids.extend(cached.new_token_ids)
            self.output_token_ids.extend(cached.new_token_ids)


@dataclass(slots=True)
class StepChunk:
    """A scheduled chunk as the runner builds inputs from it: the plan's chunk plus the block
    tables of its request (a reference to the runner's own lists, not a copy)."""

    request_id: str
    start: int
    num_tokens: int
    block_ids: list[list[int]]    # every layer group's block table
    sample: bool
    prompt_logprobs: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's floors (RunnerRequestState): the lowest key position a sliding-window layer
    # may see, and the first position whose K/V full-attention layers write.
    window_floor: int = 0
    write_floor: int = 0
    model_state: dict = field(default_factory=dict)   # the request's (RunnerRequestState.model_state)


def release_model_state(model_state: dict) -> None:
    """Give back what a model holds for a request outside its model_state: each value with a
    release() (DeepSeek-V4's compressor ring slot, models/deepseek_v4/rings.py)."""
    for value in list(model_state.values()):
        release = getattr(value, "release", None)
        if callable(release):
            release()


def update_states(states: dict[str, RunnerRequestState], plan: SchedulerPlan, device: torch.device) -> None:
    # Finished first: a request preempted and readmitted by one schedule is also new.
    for request_id in plan.finished_request_ids:
        state = states.pop(request_id, None)
        if state is not None:
            release_model_state(state.model_state)
    for new in plan.new_requests:
        states[new.request_id] = RunnerRequestState.from_new(new, device)
    for cached in plan.cached_requests:
        states[cached.request_id].apply(cached)


def step_chunks(states: dict[str, RunnerRequestState], chunks: list[ScheduledChunk]) -> list[StepChunk]:
    out = []
    for c in chunks:
        state = states[c.request_id]
        out.append(StepChunk(c.request_id, c.start, c.num_tokens, state.block_ids, c.sample, c.prompt_logprobs,
                             c.spec_token_ids, state.window_floor, state.write_floor, state.model_state))
    return out
