"""Engine configuration: frozen dataclasses, one per concern, composed into EngineConfig.

Field names follow vLLM's (`max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
`gpu_memory_utilization`, `enable_prefix_caching`, ...) so that `LLM(**kwargs)` and the CLI flags
read the same as there. Values derived at run time (the number of KV blocks, EOS ids) are not
stored here; the engine keeps them beside the config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from deepinfer.lora.config import LoRAConfig
from deepinfer.multimodal.config import MultiModalConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --dtype also takes these; ModelConfig stores the name they stand for.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
QUANTIZATIONS = ("auto", "none", "fp8")
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
POLICIES = ("fcfs", "priority")
SPEC_METHODS = ("ngram", "draft_model", "mtp", "replay")
SPEC_VERIFICATION = ("adaptive", "fixed")
# Methods whose drafts can be made on the device, from tokens the host has not seen yet.
CHAIN_METHODS = ("ngram", "replay")
MAX_VERIFY_CHAIN = 16
# The most rows a decode CUDA graph is captured for when max_cudagraph_capture_size is unset
# (ModelConfig.graph_rows); a step with more rows runs eagerly.
DEFAULT_MAX_GRAPH_ROWS = 512
# auto: the model's dtype; fp8 (= fp8_e4m3, vLLM's names): float8 e4m3 with a scale of 1.0;
# fp8_e5m2: float8 e5m2 (deepinfer/kv_cache/dtypes.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
EXECUTOR_BACKENDS = ("mp", "ray", "uni")
EXPERT_PARALLEL_DISPATCH = ("all_to_all", "all_reduce")
KV_ROLES = ("both", "prefill", "decode", "encode")
KV_STORE_LOAD_POLICIES = ("auto", "always")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how to load it.

    The string below each field is its user-facing description: `deepinfer --help` shows it
    (cli/flags.py reads these strings), so keep it about what a user sets, not how it works.
    """

    model: str | None = None
    """HF directory, .gguf file or hub id; None: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto (the platform's default: bf16 on CUDA and CPU) | float32 | bfloat16 | float16;
    vLLM's aliases half (float16) and float (float32) are accepted."""
    max_model_len: int | None = None
    """Longest prompt plus output, in tokens (the flag also takes 4k = 4,000 and 4K = 4,096);
    unset (or auto, -1): the model's own context length."""
    seed: int = 0
    """vLLM's engine seed. deepinfer seeds sampling per request (SamplingParams.seed)."""
    served_model_name: str | None = None
    """The model id in prefix-cache keys and responses; unset: the model's own name."""
    quantization: str = "auto"
    """auto: on the CPU in bf16, GGUF 4-bit matrices (and a Q8_0 head) also keep a 4-bit copy
    for small batches and dense weights a oneDNN-packed copy for large ones | none: plain
    dense dequantized weights only (the reference path) | fp8: the projections' weights kept as
    FP8 e4m3 with one scale per output channel, quantized at load, and multiplied as FP8 with
    the activations quantized per token (vLLM's dynamic FP8; layers/quantization/fp8.py); the
    embeddings, the head and the norms stay in the model's dtype."""
    attention_backend: str = "auto"
    """auto (the platform's choice: triton on CUDA when Triton imports, cpu on the CPU) | reference
    (plain PyTorch, what the fast paths are checked against) | cpu | triton. Read once, by
    layers/attention/backends/selection.py."""
    enforce_eager: bool = False
    """Run every step eagerly (no CUDA graphs for decode steps)."""
    max_cudagraph_capture_size: int | None = None
    """The most rows (query tokens) a captured decode graph takes; a step with more runs
    eagerly. Unset: max_num_seqs x (1 + num_speculative_tokens), at most DEFAULT_MAX_GRAPH_ROWS
    (`graph_rows`)."""
    trust_remote_code: bool = False
    """Accepted for vLLM launch lines; deepinfer never runs code from a model repository, so it
    has no effect."""
    generation_config: str = "auto"
    """Default sampling parameters: auto (the model's generation_config.json) | vllm (none:
    SamplingParams' own defaults) | a directory holding a generation_config.json."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids, outputs carry token ids and empty text."""
    tokenizer: str | None = None
    """Where the tokenizer (and chat template) come from instead of the model: an HF directory
    with a tokenizer.json, a .gguf file, or a hub id. Unset: the model's own."""
    revision: str | None = None
    """The revision (branch, tag or commit) of a hub model to download; it also roots the
    prefix-cache keys. Unset: the default branch."""
    hf_overrides: str | None = None
    """A JSON object merged into the model's config.json before the model is built, e.g.
    '{"rope_scaling": {...}}' (LLM also takes a dict)."""
    override_generation_config: str | None = None
    """A JSON object of default sampling settings, in generation_config.json's keys (temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens): merged over the model's
    (generation_config auto or a directory), or the only ones (generation_config vllm)."""

    pooler_config: str | None = None
    """Embeddings (/v1/embeddings, LLM.embed): a JSON object, vLLM's keys: pooling_type LAST (the
    last token's final hidden state, the default) | MEAN | CLS (the first token's), and normalize
    (true, the default: L2-normalized vectors). vLLM's --override-pooler-config is the same flag."""

    def graph_rows(self, max_num_seqs: int, rows_per_request: int) -> int:
        """The most rows a captured decode graph takes: max_cudagraph_capture_size, or a step of
        max_num_seqs requests of rows_per_request rows each (1 + the drafts a request verifies),
        at most DEFAULT_MAX_GRAPH_ROWS."""
        return self.max_cudagraph_capture_size or min(max_num_seqs * rows_per_request, DEFAULT_MAX_GRAPH_ROWS)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        # Frozen: normalising the alias in place is the one write __post_init__ allows itself,
        # so that everything after construction sees one spelling per dtype.
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join([*DTYPES, *DTYPE_ALIASES])}, got {self.dtype!r}")
        size = self.max_cudagraph_capture_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 8192):
            raise ValueError(f"max_cudagraph_capture_size must be an integer in [1, 8192], got {size!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, "
                             f"got {self.generation_config!r}")
        if self.trust_remote_code:
            logger.info("trust_remote_code has no effect: deepinfer never runs code from a model repository")
        if self.revision is not None and (self.model is None or os.path.exists(os.path.expanduser(self.model))):
            logger.warning("revision=%r is ignored: %s is not a hub model", self.revision,
                           self.model or "the embedded model")
        # A dict (LLM) is kept as its JSON text.
        for name in ("hf_overrides", "override_generation_config", "pooler_config"):
            object.__setattr__(self, name, json_object(name, getattr(self, name)))

    def json_field(self, name: str) -> dict[str, Any]:
        """A JSON-object field (hf_overrides, override_generation_config, pooler_config) as a dict;
        {} if unset."""
        value = getattr(self, name)
        return {} if value is None else json.loads(value)


def parse_json_object(name: str, value: Any) -> dict:
    """A flag's JSON object, given as text (the CLI) or a dict; errors name the field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (or a dict), got {type(value).__name__}")
    return value


def json_object(name: str, value: Any) -> str | None:
    """A flag's JSON object (text or a dict) as canonical JSON text."""
    return None if value is None else json.dumps(parse_json_object(name, value), sort_keys=True)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block (a power of two)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations and KV cache)."""
    cpu_kv_cache_bytes: int = 2 << 30
    """The KV pool's byte budget on the CPU."""
    enable_prefix_caching: bool = True
    """Reuse the KV of a prompt prefix computed before (hash-chained full blocks)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks, overriding the memory budget (tests, benchmarks)."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype) | fp8 = fp8_e4m3 (float8 e4m3 with a scale of 1.0) | fp8_e5m2
    (float8 e5m2: attention then runs on the reference backend, the fast kernels read e4m3)."""
    swa_retention_s: float = 180.0
    """Seconds a cached sliding-window block is kept after its last use; older ones are never
    hit and are reused first. Full-attention blocks stay cached until evicted."""
    swa_replay_tokens: int | None = None
    """SWA Bounded Replay: when full-attention KV covers a prefix whose sliding-window KV is
    gone, recompute only its last this many tokens (sliding-window layers attend inside them
    alone; an approximation). Unset: the model's window. 0: exact (recompute the whole prompt)."""
    swa_replay_full_kv: str = "keep"
    """keep | recompute: whether replayed positions keep their cached full-attention KV (exact
    rows) or recompute it too."""
    kv_offloading_size: float | None = None
    """GiB of host memory for a second KV tier (vLLM's name): full blocks are copied there as
    they are computed, and a prefix the device no longer holds is loaded back from it instead
    of recomputed. Unset or 0: no host tier. Sliding-window KV is never offloaded."""
    kv_store: str | None = None
    """A persistent KV store shared between instances: dir://PATH (a directory: local SSD, or a
    shared mount) or redis://HOST:PORT/DB. Full blocks are written there off the step and a
    prefix found there is loaded instead of recomputed; a store that is down or full only costs
    recomputation. Not with kv_offloading_size (one tier at a time). Sliding-window KV is never
    stored."""
    kv_store_size: float | None = None
    """GiB a dir:// store may hold; past it, least recently used entries are dropped. Unset: no
    limit (retention alone). Redis: use its maxmemory policy instead."""
    kv_retention: str = "chat=7d,agent=3d"
    """How long a stored KV entry lives after its last use, per traffic class: CLASS=DURATION
    pairs, comma-separated, durations in s, m, h or d. Blocks take the class "chat" unless told
    otherwise, so it must be named."""
    kv_store_load_timeout_s: float = 5.0
    """A load from kv_store not read within this many seconds fails; the request recomputes."""
    kv_store_buffer_size: float = 4.0
    """GiB of host memory every block passes through between the device and kv_store (page-locked
    on a GPU, allocated at start): saves waiting to be written, loads read and not yet copied in,
    half each. It bounds neither what is stored nor what is loaded: a longer prompt streams
    through it (a save waits for room, holding its device blocks; a load is read in pieces)."""
    kv_store_load_policy: str = "auto"
    """auto: a prefix found in kv_store is loaded only while loading it is measured faster than
    computing it (on a fast GPU a long prefix can compute faster than it reads), else computed;
    one hit in 16 is still loaded to follow the store's speed. always: every hit is loaded. A
    decode instance (kv_role=decode) always loads."""
    kv_store_layerwise_load: bool = False
    """A load from kv_store is handed to the step as soon as every entry of it is read and
    checked: its last copies into the device blocks run layer by layer beside that step's
    forward, each attention layer waiting only for its own layer's copies. False: a request's
    prefix is copied in whole before its remaining prompt is computed."""
    kv_role: str = "both"
    """prefill | decode | both: this instance's part in prefill/decode disaggregation, KV handed
    over through kv_store (`deepinfer router --prefill URL`). prefill: a request is answered only
    once its prompt's blocks are written to the store, so a decode instance asked next finds
    them. decode: loads from the store and writes nothing to it. A load that fails or is slow
    recomputes (vLLM's kv_load_failure_policy=recompute); sliding-window layers are rebuilt by
    Bounded Replay, never transferred. both: what an instance without a role does. encode (E/P/D,
    docs/vision.md): a vision model's encoder alone (no language model, no KV), serving POST
    /v1/encode and writing each image's encoder output to kv_store, where the other instances look
    before encoding (`deepinfer router --encoder URL`)."""
    kv_events_endpoint: str | None = None
    """Publish KV cache events (vLLM's BlockStored, BlockRemoved and AllBlocksCleared, msgpack) on a
    ZMQ PUB socket at this endpoint, e.g. tcp://*:5557 (an address with * is bound, any other is
    connected to). Unset: no events."""
    kv_events_replay_endpoint: str | None = None
    """A ZMQ ROUTER endpoint (bound) where a subscriber that missed event batches asks for them
    again from a sequence number (vLLM's replay protocol). Unset: no replay."""
    kv_events_topic: str = ""
    """The topic frame of every KV event message, for subscribers to filter on."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes must be >= 1, got {self.cpu_kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not self.swa_retention_s >= 0:   # also refuses NaN
            raise ValueError(f"swa_retention_s must be >= 0, got {self.swa_retention_s}")
        if self.swa_replay_tokens is not None and (isinstance(self.swa_replay_tokens, bool)
                                                   or not isinstance(self.swa_replay_tokens, int)
                                                   or self.swa_replay_tokens < 0):
            raise ValueError(f"swa_replay_tokens must be an integer >= 0, got {self.swa_replay_tokens!r}")
        if self.swa_replay_full_kv not in ("keep", "recompute"):
            raise ValueError(f"swa_replay_full_kv must be 'keep' or 'recompute', got {self.swa_replay_full_kv!r}")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float))
                                 or not 0 <= size < math.inf):
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0 (or unset), got {size!r}")
        if self.kv_store is not None:
            if not isinstance(self.kv_store, str) or not self.kv_store.startswith(("dir://", "redis://",
                                                                                    "rediss://", "unix://")):
                raise ValueError(f"kv_store must be dir://PATH or redis://HOST:PORT/DB, got {self.kv_store!r}")
            if self.kv_store == "dir://":
                raise ValueError("kv_store dir:// needs a path, e.g. dir:///mnt/kv")
            if self.kv_offloading_size:
                raise ValueError("kv_store and kv_offloading_size are both set: one KV tier at a time "
                                 "(a host tier in front of a store is not supported yet); unset one")
        store_size = self.kv_store_size
        if store_size is not None and (isinstance(store_size, bool) or not isinstance(store_size, (int, float))
                                       or not 0 < store_size < math.inf):
            raise ValueError(f"kv_store_size must be a number of GiB > 0 (or unset), got {store_size!r}")
        parse_retention(self.kv_retention)
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role != "both" and self.kv_store is None:
            raise ValueError(f"kv_role={self.kv_role!r} hands KV over through a store: set kv_store "
                             "(dir://PATH or redis://HOST:PORT/DB), the same on the prefill and decode instances")
        if self.kv_store_load_policy not in KV_STORE_LOAD_POLICIES:
            raise ValueError(f"kv_store_load_policy must be one of {', '.join(KV_STORE_LOAD_POLICIES)}, "
                             f"got {self.kv_store_load_policy!r}")
        if not (isinstance(self.kv_store_load_timeout_s, (int, float)) and self.kv_store_load_timeout_s > 0):
            raise ValueError(f"kv_store_load_timeout_s must be > 0, got {self.kv_store_load_timeout_s!r}")
        if not (isinstance(self.kv_store_buffer_size, (int, float)) and self.kv_store_buffer_size > 0):
            raise ValueError(f"kv_store_buffer_size must be a number of GiB > 0, got {self.kv_store_buffer_size!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.startswith(_ZMQ_SCHEMES)
                                      or value.split("://", 1)[1] == ""):
                raise ValueError(f"{name} must be a ZMQ endpoint ({', '.join(s + '...' for s in _ZMQ_SCHEMES)}, "
                                 f"e.g. tcp://*:5557), got {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the events it replays)")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_retention(text: str) -> dict[str, float]:
    """kv_retention ("chat=7d,agent=3d") as {class: seconds}; errors name the field."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"kv_retention must be CLASS=DURATION pairs like 'chat=7d,agent=3d', got {text!r}")
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, duration = (p.strip() for p in part.partition("="))
        if not sep or not name or not duration:
            raise ValueError(f"kv_retention: {part.strip()!r} is not CLASS=DURATION (e.g. chat=7d)")
        if not name.replace("_", "").replace("-", "").isalnum() or len(name) > 16:
            raise ValueError(f"kv_retention: class name {name!r} must be letters, digits, - or _ "
                             "(16 at most)")
        if name in out:
            raise ValueError(f"kv_retention: class {name!r} is given twice")
        unit = duration[-1].lower()
        number = duration[:-1] if unit in _DURATION_UNITS else duration
        try:
            seconds = float(number) * _DURATION_UNITS.get(unit, 1.0)
        except ValueError:
            raise ValueError(f"kv_retention: {name}={duration!r} is not a duration (a number with s, m, h "
                             "or d, e.g. 7d)") from None
        if not 0 < seconds < math.inf:
            raise ValueError(f"kv_retention: {name}={duration!r} must be a positive duration")
        out[name] = seconds
    if "chat" not in out:
        raise ValueError(f"kv_retention must name the class 'chat' (the default of every block), got {text!r}")
    return out


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = None
    """Most requests in one step. Unset: the platform's value when the engine starts
    (Platform.batch_limits): 512 on a CUDA card of 70 GiB or more, 256 on a smaller card or the CPU."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one step. Unset: the platform's value: 16384 offline (8192 served) on a
    CUDA card of 70 GiB or more, 8192 (2048) on a smaller card, 2048 on the CPU."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps, beside running decodes."""
    policy: str = "fcfs"
    """fcfs (arrival order) | priority (the request's priority, then arrival)."""
    long_prefill_token_threshold: int = 0
    """The most prompt tokens one request computes in a step (a long prompt's chunks are cut
    to it, so it leaves budget to others); 0: no limit beyond max_num_batched_tokens."""
    structured_outputs_compile_timeout_s: float = 30.0
    """A request whose grammar is not compiled within this many seconds fails (alone); a
    request may set its own limit."""
    async_scheduling: bool | None = None
    """Plan and launch step N+1 while the device runs step N. Unset: on with CUDA (without
    speculative decoding), off on the CPU (engine/overlapped_loop.py)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError("structured_outputs_compile_timeout_s must be positive, "
                             f"got {self.structured_outputs_compile_timeout_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {threshold!r}")

    def with_batch_limits(self, limits: tuple[int, int]) -> SchedulerConfig:
        """This config with its unset (max_num_seqs, max_num_batched_tokens) taken from `limits`."""
        seqs, tokens = limits
        return dataclasses.replace(self, max_num_seqs=self.max_num_seqs or seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens or tokens)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices and engines (vLLM's names and values)."""

    tensor_parallel_size: int = 1
    """Ranks each layer's weights are split over (attention heads, MLP rows, the vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split into: not implemented, only 1."""
    data_parallel_size: int = 1
    """Engine cores behind one server, each with its own KV pool; requests go to the least loaded."""
    enable_expert_parallel: bool = False
    """MoE experts split over the tensor-parallel ranks (each rank holds 1/tp of them whole,
    tokens sent to their experts' ranks by all-to-all) instead of every expert's rows split."""
    expert_parallel_dispatch: str = "all_to_all"
    """all_to_all | all_reduce: how an expert-parallel MoE layer whose tokens every rank holds
    reaches other ranks' experts: each rank sends its share of the tokens to the experts' ranks
    and gathers the results (all-to-all), or each rank runs its experts on every token routed
    to them and one all-reduce sums the parts. The same results; only the communication differs."""
    distributed_executor_backend: str | None = None
    """mp | ray | uni: how ranks are started (executor/factory.py, executor_class). None:
    uni for one rank, mp for several on this host (vLLM's default)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        if self.pipeline_parallel_size > 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size}: pipeline parallelism is not "
                             "implemented; use tensor_parallel_size (and data_parallel_size) instead")
        if self.expert_parallel_dispatch not in EXPERT_PARALLEL_DISPATCH:
            raise ValueError(f"expert_parallel_dispatch must be one of {', '.join(EXPERT_PARALLEL_DISPATCH)}, "
                             f"got {self.expert_parallel_dispatch!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                             f"{self.tensor_parallel_size}: use 'mp' (this host) or 'ray' (a Ray cluster)")

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (data-parallel engines are separate worlds)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs: the one asked for, else uni for one rank and mp for several."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (DSpark): `speculative_config={...}` / `--speculative-config JSON`.

    method: ngram (prompt lookup, model-free) | draft_model (a second model sharing the
        tokenizer, `model`) | mtp (the model's own multi-token-prediction head) | replay (a
        recorded continuation with a set acceptance rate, `replay_path`: measures the
        verification machinery at a controlled acceptance, spec_decode/replay.py).
    num_speculative_tokens: drafts proposed per request and step (k).
    verification: adaptive (each step admits the draft positions whose expected accepted tokens
        per unit of step cost pay off, across the batch) | fixed (every proposed draft, up to k).
    verify_chain: the most verify steps one plan runs back to back on the device (1: off). The
        second and later steps draft on the device from the tokens the one before accepted
        (ngram and replay only), so the host plans once per chain instead of once per step
        (worker/spec/verify_chain.py says when a plan qualifies); their tokens reach the caller
        together, when the chain is collected.
    enforce_eager: draft_model only: run the draft model eagerly (True) or replay its decode
        steps in CUDA graphs (False); unset: as the target model does.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    model: str | None = None               # the draft model (draft_model only)
    verification: str = "adaptive"
    prompt_lookup_max: int = 4             # ngram: longest suffix n-gram searched for
    prompt_lookup_min: int = 1             # ngram: shortest
    replay_path: str | None = None         # replay: the JSON-lines recording (spec_decode/replay.py)
    verify_chain: int = 1
    enforce_eager: bool | None = None      # draft_model: None follows the target's enforce_eager

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name} {why}, got {getattr(self, name)!r}")

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {', '.join(SPEC_METHODS)}")
        if (isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int)
                or not 1 <= self.num_speculative_tokens <= 64):
            raise bad("num_speculative_tokens", "must be an integer in [1, 64]")
        if self.verification not in SPEC_VERIFICATION:
            raise bad("verification", f"must be one of {', '.join(SPEC_VERIFICATION)}")
        if self.method == "draft_model" and not self.model:
            raise bad("model", "must name the draft model (a path) when method is 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise bad("model", f"is only used by method 'draft_model' (method is {self.method!r})")
        if self.enforce_eager is not None and (not isinstance(self.enforce_eager, bool) or self.method != "draft_model"):
            raise bad("enforce_eager", "must be true or false, and is only used by method 'draft_model'")
        if self.method == "replay" and not self.replay_path:
            raise bad("replay_path", "must name the recording (a JSON-lines file) when method is 'replay'")
        if self.method != "replay" and self.replay_path is not None:
            raise bad("replay_path", f"is only used by method 'replay' (method is {self.method!r})")
        if (isinstance(self.verify_chain, bool) or not isinstance(self.verify_chain, int)
                or not 1 <= self.verify_chain <= MAX_VERIFY_CHAIN):
            raise bad("verify_chain", f"must be an integer in [1, {MAX_VERIFY_CHAIN}]")
        if self.verify_chain > 1 and self.method not in CHAIN_METHODS:
            raise bad("verify_chain", f"above 1 needs a method that drafts on the device "
                      f"({', '.join(CHAIN_METHODS)}; method is {self.method!r})")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise bad("prompt_lookup_min", "must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise bad("prompt_lookup_max", "must be an integer >= prompt_lookup_min")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI flag), an instance, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        value = parse_json_object("speculative_config", value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.parallel.world_size > 1 and (self.cache.kv_store or self.cache.kv_offloading_size):
            # Each rank would hold its own heads' slice of every block in the tier, and the
            # scheduler side would have to agree with all of them on what is there.
            raise ValueError("kv_store and kv_offloading_size work with tensor_parallel_size=1 only in this build, "
                             f"got tensor_parallel_size={self.parallel.tensor_parallel_size}")
        if (self.model.skip_tokenizer_init and self.speculative is not None
                and self.speculative.method == "draft_model"):
            raise ValueError("speculative_config method 'draft_model' checks that the draft model shares "
                             "the target's tokenizer, so it cannot run with skip_tokenizer_init=True")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword arguments; unknown names are an error. (vLLM's names
        without a field here: vllm_compat.engine_config, what LLM and the CLI call.)"""
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        parts: dict[str, dict[str, Any]] = {part: {} for part in _FLAT_PARTS}
        owners = {f.name: part for part, klass in _FLAT_PARTS.items() for f in dataclasses.fields(klass)}
        for name, value in kwargs.items():
            if name not in owners:
                raise TypeError(f"unknown engine argument {name!r}; known: "
                                f"{', '.join(sorted([*owners, 'speculative_config']))}")
            parts[owners[name]][name] = value
        return cls(**{part: klass(**parts[part]) for part, klass in _FLAT_PARTS.items()}, speculative=speculative)


# The EngineConfig parts whose fields are flat keyword arguments (LLM(**kwargs), CLI flags).
# Field names are unique across them, which is what lets the flat names work.
_FLAT_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
               "multimodal": MultiModalConfig, "lora": LoRAConfig}


def resolve_max_model_len(config: EngineConfig, hf_config: dict) -> int:
    model_len = hf_config.get("max_position_embeddings") or 2048
    wanted = config.model.max_model_len
    if wanted is None:
        return model_len
    if wanted > model_len:
        raise ValueError(f"max_model_len={wanted} is longer than the model's context ({model_len})")
    return wanted


def fit_block_size(config: EngineConfig, multiple: int) -> EngineConfig:
    """The config with a KV block size that is a multiple of `multiple` (a model's requirement,
    CausalLM.block_size_multiple): the default block size is raised to the smallest power of two
    that is one; a block size the user chose that is not one is refused."""
    block_size = config.cache.block_size
    if block_size % multiple == 0:
        return config
    if block_size != CacheConfig.block_size:
        raise ValueError(f"block_size={block_size}: this model needs a multiple of {multiple} "
                         "(its KV compress rates); leave block_size unset or pick such a power of two")
    fitted = 1 << max(block_size - 1, multiple - 1).bit_length()
    if fitted % multiple:
        raise ValueError(f"this model needs a KV block size that is a multiple of {multiple}, "
                         "and no power of two is")
    logger.info("block_size %d -> %d: the model's KV compress rates need a multiple of %d",
                block_size, fitted, multiple)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=fitted))
