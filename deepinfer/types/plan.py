"""The typed boundaries of the engine core. Read this file first.

Every engine step is:

    plan = scheduler.schedule()                      # SchedulerPlan: final once returned
    forward = executor.execute_model(plan)           # ForwardStep: a handle, the tensors stay in the worker
    launched = executor.sample_tokens(forward, grammar)   # grammar: GrammarOutput (filled masks) or None
    result = executor.collect(launched)              # RunnerResult
    outputs = scheduler.update(plan, result)         # list[EngineCoreOutput]

Nothing else crosses between the scheduler and the runner: the runner never sees a Request, the
scheduler never sees a tensor (GrammarOutput's mask is the one tensor, made on the host beside
the scheduler). Every type here is a plain value that a later multi-process executor can send
to its workers as it is: nothing in it is live (no Future, no lock) or changes after it is made.

Per-request state crosses once: a request (re)joining the runner comes whole (NewRequestData,
with its block tables); while it runs, a plan carries only what changed (CachedRequestData:
block-table diffs, see types/block_tables.py). The runner keeps its own copy and applies them.

Also here: the KV layout the executor reports at start (KVCacheConfig), what the core returns
per request (EngineCoreOutput) and its gauges and counters (EngineStats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer.outputs import Logprob
from deepinfer.pooling_params import PoolingParams
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.lora import LoRARequest
from deepinfer.types.spec_stats import SpecDecodeStats
from deepinfer.types.tier_stats import KVTierMetrics

if TYPE_CHECKING:
    import torch


# ------------------------------------------------------------------------------ start-up
@dataclass(frozen=True)
class KVCacheConfig:
    """The KV layout the executor settled on at start (vLLM's name): layer groups, and the
    number of blocks its memory budget holds. The engine core sizes its KV manager from it."""

    groups: list            # kv_cache.specs.KVCacheGroup, one per layer group
    num_blocks: int            # including the null block 0, which no request owns
    block_size: int
    # Per pool (kv_cache/tensors.py): num_blocks, but fewer in a pool of bounded kinds. None: all num_blocks.
    pool_blocks: list[int] | None = None


# ------------------------------------------------------------------- scheduler -> runner
@dataclass
class NewRequestData:
    """Sent once when a request (re)joins the runner: what it keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]   # non-empty when a preempted request resumes
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[list[int]]    # every layer group's block table (a copy: the scheduler changes its own)
    # SWA Bounded Replay (kv_cache/manager.py): when the request resumes on cached full-attention
    # KV whose sliding-window KV is gone, it recomputes from `window_floor` on, and
    # sliding-window layers see no key below that position (the rows below were never rebuilt).
    # Full-attention layers write no K/V below `write_floor`: they keep their cached, exact rows
    # (swa_replay_full_kv="keep"). Both 0: a plain request.
    window_floor: int = 0
    write_floor: int = 0
    # A pooling request (an embedding; resolved: pooling_type and normalize set): its chunks are
    # never sampled, and the step that computes its last prompt token returns its vector.
    pooling: PoolingParams | None = None
    # The LoRA adapter its rows take (the runner reads it into a slot if it is not in one), or
    # None: the base model. The scheduler admits at most max_loras distinct ones, so the runner
    # always finds a slot that no request it holds is using.
    lora: LoRARequest | None = None


@dataclass
class BlockTableDiff:
    """How one layer group's block table changed since the runner last heard of the request.

    Applied as: table[:num_null] become the null block, then table[start:] = new_block_ids.
    Tables change in three ways: blocks are appended (allocation); leading entries become the
    null block (a sliding-window group frees blocks behind its window; the null entries are
    always a prefix of the table); the tail is cut (speculative decoding gives back the blocks
    of rejected drafts), so `start` can be shorter than the runner's table.
    """

    num_null: int
    start: int
    new_block_ids: list[int]


@dataclass
class CachedRequestData:
    """A scheduled request the runner already holds: only what changed (vLLM's name).

    A plan carries one only for a request whose state changed; a decode inside its last
    block sends nothing but its chunk."""

    request_id: str
    block_table_diffs: list[BlockTableDiff] | None = None   # one per layer group; None: no table changed
    # Tokens the runner did not sample itself, appended after dropping its last
    # `num_dropped_tokens` (a draft model's runner: the target accepted other tokens than the
    # drafts it sampled). The target's runner samples every token it holds: both stay empty.
    new_token_ids: list[int] = field(default_factory=list)
    num_dropped_tokens: int = 0


@dataclass
class ScheduledChunk:
    """Compute KV for tokens [start, start + num_tokens) of one request this step."""

    request_id: str
    start: int
    num_tokens: int
    # True when the chunk reaches the end of the known tokens, so its last position is sampled.
    sample: bool
    prompt_logprobs: bool = False  # also return logprobs of the prompt tokens in this chunk
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify (DSpark issue)

    @property
    def is_generating(self) -> bool:
        """One known token (plus any drafts), sampled: a request generating, not prefilling."""
        return self.sample and self.num_tokens == 1 + len(self.spec_token_ids)


@dataclass
class KVTransfer:
    """One copy between the device pool and a KV tier, of whole blocks of one layer group:
    device_block_ids[i] <-> tier_slots[i] (kv_cache/connector.py)."""

    transfer_id: int
    request_id: str               # whose KV (a load), or the request that computed it (a save)
    group_id: int
    device_block_ids: list[int]
    tier_slots: list[int]         # host tier: its slots; persistent stores: unused (empty)
    # Persistent stores: the blocks' hashes, and the retention class they are written or touched
    # under (None: "chat"). Their entries are runs of blocks (kv_cache/store/runs.py): run_lengths
    # cuts device_block_ids / block_hashes into them in order, each entry named by its last
    # block's hash. A load reads whole runs: a block it must not write (on the device already,
    # its hash then b"") has device id SKIP_BLOCK.
    block_hashes: list[bytes] = field(default_factory=list)
    traffic_class: str | None = None
    run_lengths: list[int] = field(default_factory=list)


# A block of a persistent store's load that is read with its run but not copied to the device.
SKIP_BLOCK = -1


@dataclass
class KVConnectorMetadata:
    """What the KV connector's worker side starts this step (vLLM's name). Loads fill device
    blocks of requests parked in WAITING_FOR_KV; saves copy blocks a finished step computed.
    Both run asynchronously; the runner reports each transfer_id once done (RunnerResult)."""

    loads: list[KVTransfer] = field(default_factory=list)
    saves: list[KVTransfer] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves)


@dataclass(frozen=True)
class SchedulerPlan:
    """One step's work. Final when `schedule()` returns: nobody adds to it afterwards (the
    structured-output masks travel apart, as a GrammarOutput given to `sample_tokens`)."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    chunks: list[ScheduledChunk]
    # The runner drops their state. Applied before new_requests: a request preempted and
    # readmitted by one schedule is in both, and must come back whole.
    finished_request_ids: list[str]
    num_scheduled_tokens: int
    kv_connector_metadata: KVConnectorMetadata | None = None   # None: no KV connector configured
    # Verify steps the runner may run back to back for this plan (worker/spec/verify_chain.py): every
    # chunk's request generates and holds KV blocks for verify_chain * (k + 1) tokens. 1: one step.
    verify_chain: int = 1
    # The step's image work (multimodal/encoder_cache.ImageStepPlan: encode, drop, place), or None.
    images: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def is_decode_only(self) -> bool:
        """Every chunk a generating request's (decode-shaped: step-time models are fitted to those)."""
        return bool(self.chunks) and all(c.is_generating for c in self.chunks)


# A grammar mask row is keyed by request id, or by (request id, j) for a request verifying
# drafts: row j is the mask after its drafts 1..j.
GrammarRowKey = str | tuple[str, int]


@dataclass(frozen=True)
class GrammarOutput:
    """The filled structured-output masks of one step (vLLM's name), handed to sampling.

    The engine core fills them in a worker thread while the step's forward runs, and waits for
    the fill only right before `sample_tokens`; so the mask is a finished value by the time it
    crosses (sample/structured/bitmask.py applies it)."""

    rows: dict[GrammarRowKey, int]   # key -> its row in `bitmask`
    # What the runner applies: packed int32 rows (GPU), a float32 additive bias (CPU: 0 allowed,
    # -inf not, expanded by the worker), or a bool mask (True = not allowed).
    bitmask: torch.Tensor


@dataclass(frozen=True)
class ForwardStep:
    """A step whose forward the executor has queued: a handle for `sample_tokens`. The hidden
    states and logits stay in the worker."""

    step_id: int


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose sampling is queued too: a handle for `collect`, which waits for it."""

    step_id: int


# ------------------------------------------------------------------- runner -> scheduler
# Per position: {token_id: Logprob}; the sampled token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RunnerResult:
    """What one forward produced, keyed by request id."""

    sampled_token_ids: dict[str, list[int]]              # one token, or accepted drafts + one
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # KV connector transfers (KVTransfer.transfer_id) that completed since the last result.
    finished_kv_transfers: list[int] = field(default_factory=list)
    # Loads that ended without filling their blocks (KVConnectorWorker.failed_transfers): never
    # also in finished_kv_transfers; the scheduler recomputes their requests.
    failed_kv_transfers: list[int] = field(default_factory=list)
    # A verify chain (SchedulerPlan.verify_chain): per request, (drafts verified, accepted) of
    # each of its steps, whose tokens sampled_token_ids holds back to back; and how many ran.
    verify_steps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    num_verify_steps: int = 1
    # Pooling requests whose last prompt chunk ran this step: the vector, float32 little-endian.
    pooled: dict[str, bytes] = field(default_factory=dict)


# --------------------------------------------------------------------- core -> front end
@dataclass
class EngineCoreOutput:
    """What the scheduler reports per request after applying a result."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None              # with finish_reason "abort": why the request failed
    pooled: bytes | None = None           # a pooling request's vector (float32 little-endian), when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """The core's gauges and cumulative counters, sent with every step's outputs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: list[int]   # per layer group, in tokens
    prefix_cache_hits: list[int]
    prefix_cache_evictions: list[int]  # per layer group, in blocks
    spec_decode: SpecDecodeStats | None = None   # cumulative; None without speculative decoding
    prefix_cache_request_queries: int = 0    # prompt tokens of admitted requests
    prefix_cache_request_hits: int = 0       # of those, tokens not computed (num_cached_tokens)
    prefix_cache_replayed: list[int] = field(default_factory=list)     # per group, tokens (SWA replay)
    prefix_cache_expirations: list[int] = field(default_factory=list)  # per group, blocks (retention)
    kv_group_kinds: list[str] = field(default_factory=list)            # per group: full | sliding_window
    # The KV tier's counters (kv_cache/connector.py KVConnectorStats, by field name); None: no tier.
    kv_tier: dict[str, int] | None = None
    # Its /metrics figures from both sides of the connector (kv_cache/tier_stats.py); None: no tier.
    kv_tier_metrics: KVTierMetrics | None = None
    # The encoder's counters (a model that reads images; multimodal/runner_images.py counters() and
    # the encoder cache's hits), by name; None: a text-only model.
    encoder: dict[str, float] | None = None
