"""One object per request, carrying all of its state inside the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.pooling_params import PoolingParams
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_hashes import ROOT_HASH, extend_block_hashes
from deepinfer.types.lora import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"   # its structured-output grammar is compiling
    WAITING_FOR_KV = "waiting_for_kv"             # a KV tier is loading its prefix (connector)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class RequestTimes:
    """Monotonic timestamps recorded in the core; the front end turns them into latencies."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int               # resolved: never past max_model_len
    priority: int = 0             # lower runs first under the priority policy (vLLM's rule)
    cache_salt: str | None = None
    extra_key: bytes = b""        # model id + cache_salt, part of every block hash
    traffic_class: str = "chat"   # its KV's retention class in a KV store (types/traffic_class.py)
    hash_root: bytes = ROOT_HASH  # the engine's root of the hash chain (set by the scheduler)
    block_size: int = 16
    arrival_order: int = 0        # tie-break for equal priorities: first come, first served

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Positions whose KV is computed or scheduled: advanced when a chunk is scheduled, so that
    # with overlapped scheduling the next step can be planned before this one's result is in.
    num_computed_tokens: int = 0
    # Overlapped scheduling: positions and sampled tokens of chunks scheduled in steps whose
    # result the scheduler has not applied yet (always 0 between steps of the plain loop).
    num_tokens_in_flight: int = 0
    num_samples_in_flight: int = 0
    num_cached_tokens: int = 0    # prompt tokens not computed at first admission (usage)
    # SWA Bounded Replay of the current admission (NewRequestData says what they mean).
    window_floor: int = 0
    write_floor: int = 0
    kv_loaded: bool = False       # a KV tier loaded its prefix while it waited (WAITING_FOR_KV)
    skip_kv_tier: bool = False    # a load from the tier failed: recompute instead of asking again
    block_ids: list[list[int]] = field(default_factory=list)   # one block table per layer group
    # Hashes of the full blocks of all_token_ids, extended when read (`block_hashes`): an engine
    # without prefix caching never reads them, and hashing a long prompt costs host time before its
    # first kernel (docs/benchmarks/design-measurements.md#block-hashes-on-read).
    _block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    num_published_blocks: int = 0
    skip_prefix_cache: bool = False   # prompt_logprobs need every prompt position computed
    # A pooling request (an embedding): prefill only, never sampled; it finishes with its vector
    # once its last prompt token is computed (types/plan.py NewRequestData.pooling).
    pooling: PoolingParams | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    # Draft tokens to verify this step (a later issue), and the structured-output grammar
    # (a sample.structured.RequestGrammar: compile handle, then matcher) when constrained.
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: Any = None
    error: str | None = None      # why the request failed (e.g. its grammar did not compile)
    # Its images (multimodal/inputs.ImageInputs: hashes, placeholders, pixels), or None.
    images: Any = None
    # The LoRA adapter it runs under (types/lora.py; also in extra_key), or None: the base model.
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_kv_ready_tokens(self) -> int:
        """Positions whose KV was written by steps whose result has been applied."""
        return self.num_computed_tokens - self.num_tokens_in_flight

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def block_hashes(self) -> list[bytes]:
        """Hash of every full block of all_token_ids (chained: each covers the whole prefix); a
        block holding image tokens also covers those images' hashes."""
        extend = extend_block_hashes if self.images is None else self.images.extend_block_hashes
        extend(self._block_hashes, self.all_token_ids, self.block_size, self.extra_key,
                            self.hash_root)
        return self._block_hashes
