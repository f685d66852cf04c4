"""The model runner: builds the model and the KV tensors, then executes scheduler plans.

Construction is a list of steps in the order of the work (`__init__` names them): join the
tensor-parallel group -> build the model -> load weights -> lay out the KV cache -> choose the
attention backend -> size the KV pool from the memory budget -> allocate the KV tensors -> warm
up the kernels and capture decode graphs; the steps it runs on throwaway caches before serving
(memory profile, warm-up) are worker/start_up_steps.py. It is driven through an
executor (executor/), never by the engine core directly. It keeps a small state per request
(token ids, sampling params, RNG, block tables: worker/request_states.py), updated from each
plan's new requests and diffs, builds the step's inputs, runs the forward, samples, and returns
a `RunnerResult`, in three calls, none of the first two waiting for the device:
  forward(plan)              queue the forward and the logits of the rows to sample
  sample(forward, grammar)   queue sampling (grammar masks and penalties see every earlier token)
                             and the copy of the tokens to the host
  collect(launched)          wait for that step alone, return its RunnerResult
The calls take and return handles (ForwardStep, LaunchedStep in types/plan.py); the tensors
behind them stay here. Overlapped scheduling (engine/overlapped_loop.py) interleaves the calls
of two steps. Until collected, each sampled token is a PLACEHOLDER in the request's token list; a
forward that needs it as input takes it from the device tensor of the step before.

Speculative decoding's runner side is here too: a chunk with drafts is verified from `sample`
(the target's logits at every draft position; worker/spec/draft_verification.py, whose greedy
verdicts are taken at `collect`), `profile_verify_step` times verify-shaped steps for the adaptive
policy's cost model, and `propose_mtp` runs a model's own multi-token-prediction head.

LoRA adapters (enable_lora): the new requests' adapters are put in device slots as a plan arrives,
and each step's rows take their request's slot (lora/manager.py; lora/slots.step_rows).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.config import EngineConfig, resolve_max_model_len
from deepinfer.distributed import ParallelGroup, building_with
from deepinfer.distributed.parallel_state import SINGLE
from deepinfer.kv_cache.connector import KVConnectorWorker
from deepinfer.kv_cache.dtypes import resolve_cache_dtype
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store.factory import make_kv_connector_worker
from deepinfer.kv_cache.tensors import KVLayout
from deepinfer.layers.attention import forward_context
from deepinfer.layers.attention.backends import select_backend
from deepinfer.lora.manager import RunnerLoRA
from deepinfer.lora.slots import step_rows
from deepinfer.models.loader import ModelSource
from deepinfer.models.registry import model_class
from deepinfer.multimodal.runner_images import RunnerImages
from deepinfer.platforms import Platform
from deepinfer.platforms.transfer import to_device
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.sampler import DeviceSample, Sampler, SamplingRow
from deepinfer.sample.structured.bitmask import apply_grammar_bitmask
from deepinfer.spec_decode.method import SpeculativeMethod
from deepinfer.types.plan import (
    ForwardStep,
    GrammarOutput,
    KVCacheConfig,
    LaunchedStep,
    RunnerResult,
    SchedulerPlan,
)
from deepinfer.worker.input_batch import (
    MAX_CONTINUATION_ROWS,
    StepInputs,
    build_step_inputs,
    max_sliding_window,
    num_decode_rows,
)
from deepinfer.worker.kv_layer_gate import gates_every_layer, kv_layer_gate
from deepinfer.worker.kv_pool_size import bounded_pool_blocks, kv_pool_blocks
from deepinfer.worker.pooling import has_pooling, pool_step, pooled_bytes
from deepinfer.worker.request_states import (
    RunnerRequestState,
    StepChunk,
    release_model_state,
    step_chunks,
    update_states,
)
from deepinfer.worker.spec.draft_verification import PendingVerdicts, verify_chunks
from deepinfer.worker.spec.verify_chain import ChainStart, ChainVerdicts, build_verify_chain
from deepinfer.worker.start_up_steps import StartUpSteps

if TYPE_CHECKING:
    from deepinfer.types.drafter import Draft, DraftRequest
    from deepinfer.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A sampled token whose value is still on the device (see the module docstring).
PLACEHOLDER = -1


@dataclass
class _QueuedForward:
    """Behind a ForwardStep: what sampling needs from the step's forward."""

    inputs: StepInputs | None             # None: nothing to compute
    hidden: torch.Tensor | None           # None when a CUDA graph ran (it returns logits only); only
                                          # the sampled rows when no chunk needs the others (forward)
    sample_rows: list[int]                # rows of inputs.chunks sampled this step
    logits: torch.Tensor | None           # [len(sample_rows), vocab]
    # A CUDA graph's logits of every row (the graph's own output buffer: read before the next
    # replay); None when the step ran eagerly.
    row_logits: torch.Tensor | None = None
    chain: ChainStart | None = None       # the step runs a verify chain (worker/spec/verify_chain.py)
    pooled: dict[str, torch.Tensor] | None = None   # pooling requests' finished vectors (worker/pooling.py)


@dataclass
class _QueuedSample:
    """Behind a LaunchedStep: its device work is queued; `collect` turns it into a RunnerResult."""

    result: RunnerResult                  # what is known on the host already (verify, prompt logprobs)
    sampled_request_ids: list[str] = field(default_factory=list)   # one per sampled row
    sample: DeviceSample | None = None    # host copies under way
    done: torch.cuda.Event | None = None  # recorded after the copies (CUDA); None: already done
    # Greedy draft verification (or a verify chain's, ChainVerdicts), taken at collect.
    verdicts: PendingVerdicts | ChainVerdicts | None = None
    pooled: dict[str, torch.Tensor] | None = None   # the forward's finished pooling vectors


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict, platform: Platform,
                 source: ModelSource | None = None, group: ParallelGroup = SINGLE) -> None:
        """`group`: the tensor-parallel ranks this runner is one of (executor/ranked.py); every
        rank runs the same plans and gets the same logits, so each samples the same tokens."""
        self.config = config
        self.group = group
        self.hf_config = hf_config
        self.platform = platform
        self.device = platform.device
        self.dtype = platform.default_dtype if config.model.dtype == "auto" else DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.speculation = SpeculativeMethod.resolve(config.speculative)   # None: no drafts to verify
        self._join_group()
        self.platform.note_memory_baseline()   # before the weights: what the card holds is others'
        self._build_model(source)
        self._load_weights(source)
        # LoRA adapters' device slots (lora/manager.py), before the memory budget is measured; None: off.
        self.lora = RunnerLoRA.for_config(self.model, config.lora)
        self._lay_out_kv_cache()
        self._choose_attention_backend()
        self._size_kv_pool()
        self._allocate_kv_cache()
        self._reset_steps()
        self.images = RunnerImages.for_model(self.model, hf_config, source, config)   # None: a text-only model
        self._prepare_kernels()
        # Verify chains: several verify steps of one plan, back to back on the device.
        self.verify_chain = build_verify_chain(self.speculation, self.decode_graphs, max_sliding_window(self.groups),
                                               hf_config["vocab_size"], config.model.seed, self.device)
        self._seed_ranks()

    # ------------------------------------------------------------------------------- set-up
    def _join_group(self) -> None:
        """Tensor parallelism: the group's expert-parallel settings, and the host's cores shared
        with the other ranks where the forward runs on them."""
        if self.group.size > 1:
            self.group.enable_expert_parallel = self.config.parallel.enable_expert_parallel
            self.group.expert_parallel_dispatch = self.config.parallel.expert_parallel_dispatch
            self.platform.share_host_cores(self.group.size)

    def _build_model(self, source: ModelSource | None) -> None:
        """Build the model directly on the device, in the target dtype. Without weights to load
        (random weights of a real shape) the init draws from the seed, so every engine of a
        shape built with one seed holds the same weights: a benchmark's engines then compute
        the same tokens (spec_replay.py replays one engine's outputs as another's drafts)."""
        if source is None:
            torch.manual_seed(self.config.model.seed)
        cls = model_class(self.hf_config)
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), building_with(self.group):
                self.model = cls.build(self.hf_config, self.config.model.quantization, source is None).eval()
        finally:
            torch.set_default_dtype(previous_dtype)

    def _load_weights(self, source: ModelSource | None) -> None:
        """Load weights (no source: keep the random init, for benchmarks of real shapes). Where
        the forward runs on host kernels, in bf16, GGUF 4-bit matrices (and a Q8_0 head) also
        keep a 4-bit copy for small-batch decode, and dense weights a oneDNN-packed copy for
        larger batches. With quantization="fp8" the projections become FP8 once loaded."""
        host_formats = (self.config.model.quantization == "auto" and self.platform.packs_weights_for_host_kernels
                        and self.dtype == torch.bfloat16)
        if source is not None:   # 4-bit copies on one rank only (models/base.py, load_weights)
            self.model.load_from(source, keep_int4=host_formats and self.group.size == 1,
                                 quantization=self.config.model.quantization)
        else:
            self.model.random_weights(self.config.model.seed)
        if host_formats:   # dense weights also packed for oneDNN (layers/linear.py, pack_dense)
            self.model.pack_weights()
        if self.config.model.quantization == "fp8":
            self.model.quantize_fp8()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _lay_out_kv_cache(self) -> None:
        """KV layout: layer groups by KV kind, pools by page shape, slots shared across the groups
        of a pool (kv_cache/specs.py, tensors.py), stored in the model's dtype or in fp8
        (kv_cache_dtype, see kv_cache/dtypes.py)."""
        self.kv_cache_dtype = resolve_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype)
        self.kv_layout = KVLayout.from_specs(self.model.kv_cache_specs(self.dtype), self.block_size,
                                             self.kv_cache_dtype)
        self.groups: list[KVCacheGroup] = self.kv_layout.groups
        self.layer_to_group, self.layer_to_slot = self.kv_layout.layer_to_group, self.kv_layout.layer_to_slot
        self.max_blocks_per_seq = -(-self._max_model_len() // self.block_size)

    def _choose_attention_backend(self) -> None:
        """The attention backend, chosen once (layers/attention/backends/selection.py): it builds
        each step's metadata, and every layer of a forward asks it which fast ops to run."""
        engine_backend = select_backend(self.config, self.platform, self.kv_cache_dtype)
        self.attention_backend = (self.model.own_attention_backend(self.device, self.kv_cache_dtype, engine_backend)
                                  or engine_backend)
        self.start_up_steps = StartUpSteps(self.model, self.kv_layout, self.block_size, self.attention_backend,
                                           self.platform)
        # Before the KV pool is sized, so what the model keeps per request comes out of its budget.
        rows_per_request = max(1 + (self.speculation.k if self.speculation is not None else 0), MAX_CONTINUATION_ROWS)
        graphs = self.attention_backend.supports_decode_graphs and not self.config.model.enforce_eager
        self.model.reserve_request_state(self.config.scheduler.max_num_seqs, rows_per_request, graphs)

    def _size_kv_pool(self) -> None:
        """The KV pool's blocks, from the memory left (after the activation peak, where the
        platform's budget sees it); every rank of a group takes the smallest any can hold."""
        if self.platform.profiles_activation_peak:
            tokens = min(self.config.scheduler.max_num_batched_tokens, self._max_model_len())
            with step_rows(1 if self.lora is not None else None):   # the adapters' products' temporaries too
                self.start_up_steps.profile_peak_memory(tokens, min(self.config.scheduler.max_num_seqs, tokens))
        self.num_blocks, self.pool_blocks = kv_pool_blocks(
            self.config, self.kv_layout, self.platform, self.attention_backend, self.hf_config, self.weight_bytes,
            self.speculation, self.dtype, self._max_model_len())
        if self.group.size > 1:   # every rank holds the same block ids: the smallest pool any can hold
            agreed = self.group.all_min(self.num_blocks)
            if agreed != self.num_blocks:
                self.num_blocks, self.pool_blocks = agreed, self.kv_layout.pool_blocks(
                    agreed, bounded_pool_blocks(self.config, self.kv_layout), self._max_model_len())

    def _allocate_kv_cache(self) -> None:
        """The KV tensors, and the worker side of a KV tier outside the device
        (kv_offloading_size), which copies blocks between these tensors and the tier."""
        self.kv_caches = self.kv_layout.allocate(self.pool_blocks, self.device)
        logger.info("KV cache: %d blocks of %d tokens (per pool %s), %d layer groups in %d pools, %s, %.1f MiB",
                    self.num_blocks, self.block_size, self.pool_blocks, len(self.groups), self.kv_layout.num_pools,
                    str(self.kv_cache_dtype).removeprefix("torch."),
                    self.kv_layout.total_bytes(self.pool_blocks) / 2**20)
        self.kv_connector: KVConnectorWorker | None = make_kv_connector_worker(
            self.config, self.groups, self.block_size, self.device)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches, self.groups, self.block_size)
        # Whether a forward may wait for a layer-wise load's copies layer by layer (kv_layer_gate.py).
        self._gated_layers = gates_every_layer(self.model, len(self.kv_layout.layer_to_group))

    def _reset_steps(self) -> None:
        """The per-request state and the steps in flight: none yet."""
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        # Steps behind the handles given out and not redeemed yet, by step id.
        self._step_ids = itertools.count()
        self._forwards: dict[int, _QueuedForward] = {}
        self._samples: dict[int, _QueuedSample] = {}
        # The last launched step's sampled tokens (device) and each request's row in them.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None

    def _prepare_kernels(self) -> None:
        """Compile the backend's kernels with a warm-up step of each kind, then capture the CUDA
        graphs of decode steps where the backend replays them and enforce_eager is off."""
        config = self.config
        if self.attention_backend.needs_warm_up:
            self.start_up_steps.warm_up(self._max_model_len(), self.decode_splits(1))
        self.decode_graphs: DecodeGraphs | None = None
        if self.attention_backend.supports_decode_graphs and not config.model.enforce_eager:
            from deepinfer.worker.cuda_graphs import DecodeGraphs

            # With speculative decoding a request verifying k drafts is 1 + k decode rows
            # (input_batch.fits_decode_rows), so the graphs cover that many rows a request.
            rows_per_request = 1 + (self.speculation.k if self.speculation is not None else 0)
            max_rows = config.model.graph_rows(config.scheduler.max_num_seqs, rows_per_request)
            self.decode_graphs = DecodeGraphs(
                self.model, self.attention_backend, len(self.groups), self.groups[0].spec.num_kv_heads, max_rows,
                self.max_blocks_per_seq, self.block_size,
                self.layer_to_group, self.layer_to_slot, self.kv_caches, self.device, lora=self.lora is not None)
            self.decode_graphs.capture()

    def _seed_ranks(self) -> None:
        if self.group.size > 1:
            # Unseeded requests draw from the global generator: the same seed on every rank, and
            # the same draws in the same order (every rank runs every plan), keep the ranks'
            # sampled tokens identical.
            torch.manual_seed(self.config.model.seed)

    def decode_splits(self, batch: int) -> int:
        """Sequence splits of the decode kernel for a batch of this many rows (1 but on Triton)."""
        return self.attention_backend.decode_splits(batch, self.groups[0].spec.num_kv_heads)

    def _max_model_len(self) -> int:
        return resolve_max_model_len(self.config, self.hf_config)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_layout.bytes_per_block

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return KVCacheConfig(self.groups, self.num_blocks, self.block_size, self.pool_blocks)

    # ------------------------------------------------------------------------------- execute
    @torch.inference_mode()
    def forward(self, plan: SchedulerPlan) -> ForwardStep:
        """Apply the plan's request changes, then queue the step's forward and the logits of
        its sampled rows."""
        if any(s.verdicts is not None for s in self._samples.values()):
            # Its requests' token lists lack that step's tokens until then (draft_verification.py).
            raise RuntimeError("a forward was queued before the verify step in flight was collected")
        update_states(self.requests, plan, self.device)
        if self.lora is not None:   # the new requests' adapters into device slots
            self.lora.admit(plan.new_requests, self.requests)
        if self.images is not None:   # the encoder cache's work of this plan, and its image rows
            self.images.begin(plan.images)
        handle = ForwardStep(next(self._step_ids))
        connector = self._start_kv_transfers(plan)
        if plan.is_empty:   # no forward; a plan with only connector work still starts it
            if connector is not None:
                connector.after_forward()
            self._forwards[handle.step_id] = _QueuedForward(None, None, [], None)
            return handle

        token_ids = {c.request_id: self.requests[c.request_id].token_ids for c in plan.chunks}
        chunks, chain = step_chunks(self.requests, plan.chunks), None
        if self.verify_chain is not None:   # drafts padded to the plan's most where the step chains
            chunks, chain = self.verify_chain.prepare(plan.verify_chain, chunks, self.requests)
        queued = self._queue_forward(chunks, token_ids)
        queued.chain = chain
        assert chain is None or queued.row_logits is not None, "a verify chain outside a CUDA graph"
        if connector is not None:   # the saves read blocks this forward (or an earlier one) wrote
            connector.after_forward()
        self._forwards[handle.step_id] = queued
        return handle

    def _queue_forward(self, chunks: list[StepChunk], token_ids: dict[str, list[int]],
                       fill_placeholders: bool = True) -> _QueuedForward:
        """Queue one forward of `chunks`: replayed as a CUDA graph where every chunk is a decode
        row or verifies drafts as decode rows (input_batch.num_decode_rows) and a captured
        bucket holds its rows, else eagerly."""
        pooling = has_pooling(chunks, self.requests)   # its rows' hidden states: no graph (logits only)
        graphs = None if pooling else self.decode_graphs
        # Graphs replay decode rows only: a one-token chunk under a live window floor is a
        # prefill row (input_batch.is_decode_row), so its step runs eagerly.
        images = self.images.for_chunks(chunks) if self.images is not None else None   # image rows run eagerly
        rows = num_decode_rows(chunks, max_sliding_window(self.groups)) if graphs is not None and not images else None
        bucket = graphs.bucket_for(rows) if rows is not None and graphs.attention_buffers.accepts(chunks) else None
        # A graph replays with its bucket's split count; eager steps pick theirs the same way.
        decode_splits = self.decode_splits(bucket if bucket is not None else len(chunks))
        inputs = build_step_inputs(chunks, token_ids, self.groups, self.block_size,
                                   self.layer_to_group, self.layer_to_slot, self.kv_caches, self.device,
                                   backend=self.attention_backend, decode_splits=decode_splits,
                                   rows_as_decodes=bucket is not None)
        if fill_placeholders:
            self._fill_placeholders(inputs)
        if self.lora is not None:   # each row's adapter slot (a graph copies them into its own buffer)
            inputs.lora_slots = self.lora.step_rows(inputs.chunks, self.requests, self.device)
        hidden = logits = row_logits = None
        sample_rows = [i for i, c in enumerate(inputs.chunks) if c.sample and not c.spec_token_ids]
        if bucket is not None:
            with kv_layer_gate(self.kv_connector, per_layer=False):   # a graph replays ungated
                row_logits = graphs.run(inputs)    # every row's logits, drafts' rows included
            if sample_rows:   # keep the sampled rows'
                last = [inputs.last_token_index[i] for i in sample_rows]
                logits = (row_logits if len(last) == row_logits.shape[0]
                          else row_logits[to_device(last, self.device, torch.long)])
        else:
            index = (to_device([inputs.last_token_index[i] for i in sample_rows], self.device, torch.long)
                     if sample_rows else None)
            # Draft verification and prompt logprobs read other rows' hidden states (sample()). With
            # adapters too: the model would keep only the sampled rows after the last attention,
            # and the step's per-row slots would no longer line up with its MLP's rows.
            every_row = (index is None or pooling or inputs.lora_slots is not None
                         or any(c.spec_token_ids or c.prompt_logprobs for c in inputs.chunks))
            # Without LoRA the step leaves the rows' adapters as they are (a test may set them around it).
            lora_rows = step_rows(inputs.lora_slots) if self.lora is not None else contextlib.nullcontext()
            gate = kv_layer_gate(self.kv_connector, per_layer=self._gated_layers)
            with forward_context(inputs.attention), lora_rows, gate:
                hidden = self.model(inputs.input_ids, inputs.positions, None if every_row else index,
                                    **({} if images is None else {"images": images.step_images(inputs)}))
            if sample_rows:
                logits = self.model.compute_logits(hidden[index] if every_row else hidden)
        return _QueuedForward(inputs, hidden, sample_rows, logits, row_logits,
                              pooled=pool_step(inputs, hidden, self.requests) if pooling else None)

    def _start_kv_transfers(self, plan: SchedulerPlan) -> KVConnectorWorker | None:
        """Start the plan's KV connector loads (its saves wait for the forward); returns the
        connector when the plan has work for it."""
        meta = plan.kv_connector_metadata
        if meta is None or meta.is_empty:
            return None
        if self.kv_connector is None:
            raise RuntimeError("the plan carries KV connector transfers but this worker has no KV tier "
                               "(kv_offloading_size or kv_store differs between the scheduler and the worker)")
        # Before the forward is queued: the loads fill blocks this step's forward never reads
        # (the scheduler parks their requests until the loads are reported finished).
        self.kv_connector.start_transfers(meta)
        return self.kv_connector

    @torch.inference_mode()
    def sample(self, forward: ForwardStep, grammar: GrammarOutput | None = None) -> LaunchedStep:
        """Queue sampling after a forward; returns without waiting for the device (except for
        draft verification and prompt logprobs, which need host values at once)."""
        step = self._forwards.pop(forward.step_id)
        launched = _QueuedSample(RunnerResult(sampled_token_ids={}), pooled=step.pooled)
        handle = LaunchedStep(forward.step_id)
        self._samples[handle.step_id] = launched
        result, inputs = launched.result, step.inputs
        if inputs is None:
            return handle
        if step.sample_rows:
            logits = step.logits
            request_ids = [inputs.chunks[i].request_id for i in step.sample_rows]
            if grammar is not None:   # structured output: disallowed tokens -> -inf
                apply_grammar_bitmask(logits, grammar, request_ids)
            # Every earlier step is collected by now, so penalties and seeds see real tokens.
            # (A request that stopped on the last collected token is sampled once more here;
            # the scheduler ignores that token.)
            assert all(self.requests[r].num_placeholders == 0 for r in request_ids), "sampling before collecting"
            sample = self.sampler.sample(logits, [self._sampling_row(r) for r in request_ids])
            for request_id in request_ids:
                state = self.requests[request_id]
                state.token_ids.append(PLACEHOLDER)
                state.output_token_ids.append(PLACEHOLDER)
                state.num_placeholders += 1
            self._last_sampled = (sample.token_ids, {r: row for row, r in enumerate(request_ids)})
            launched.sampled_request_ids = request_ids
            launched.sample = sample.to_host()

        verify_rows = [i for i, c in enumerate(inputs.chunks) if c.spec_token_ids]
        if verify_rows and step.chain is not None:   # this step and the chain's next, on the device
            launched.verdicts = self.verify_chain.run(step.chain, inputs.chunks, inputs.positions,
                                                      step.row_logits, self.requests)
        elif verify_rows:   # speculative decoding: sample at every draft position, keep what passes
            launched.verdicts = self._verify_drafts([inputs.chunks[i] for i in verify_rows],
                                                    [inputs.last_token_index[i] for i in verify_rows],
                                                    step, result, grammar)

        for i, chunk in enumerate(inputs.chunks):
            if chunk.prompt_logprobs:
                result.prompt_logprobs[chunk.request_id] = self._prompt_logprobs(
                    chunk, step.hidden, inputs.last_token_index[i])
        launched.done = self.platform.record_step_done()
        return handle

    def collect(self, handle: LaunchedStep) -> RunnerResult:
        """Wait for a launched step and return its result; the requests' placeholders for its
        tokens get their values."""
        launched = self._samples.pop(handle.step_id)
        result = launched.result
        if launched.sample is not None:
            self._apply_sampled(launched)
        if launched.pooled:
            result.pooled = pooled_bytes(launched.pooled)
        if launched.verdicts is not None:
            if launched.done is not None:
                launched.done.synchronize()
            launched.verdicts.finish(self.requests, result)
        if self.kv_connector is not None:   # a poll: what finished by now, whichever step started it
            result.finished_kv_transfers = self.kv_connector.finished_transfers()
            result.failed_kv_transfers = self.kv_connector.failed_transfers()
        return result

    def _apply_sampled(self, launched: _QueuedSample) -> None:
        """Wait for a launched step's sampled tokens; they go into its result and replace the
        requests' placeholders."""
        result = launched.result
        if launched.done is not None:
            launched.done.synchronize()   # this step only; a step launched after it keeps running
        sampled = launched.sample.tolist()
        for row, request_id in enumerate(launched.sampled_request_ids):
            token = sampled.token_ids[row]
            result.sampled_token_ids[request_id] = [token]
            if sampled.logprobs[row] is not None:
                result.logprobs[request_id] = [sampled.logprobs[row].to_dict()]
            state = self.requests.get(request_id)
            if state is not None:   # else dropped since (finished, preempted): nothing to fill
                # Steps are collected in launch order, so this step's token is the oldest placeholder.
                state.token_ids[len(state.token_ids) - state.num_placeholders] = token
                state.output_token_ids[len(state.output_token_ids) - state.num_placeholders] = token
                state.num_placeholders -= 1

    def _fill_placeholders(self, inputs) -> None:
        """Input tokens sampled by the previous step but not collected yet: copy them from its
        device tensor (a device-side gather, so the host never waits for them)."""
        rows, sources = [], []
        for i, chunk in enumerate(inputs.chunks):
            state = self.requests[chunk.request_id]
            if not state.num_placeholders:
                continue
            known_end = chunk.start + chunk.num_tokens - len(chunk.spec_token_ids)
            if known_end <= len(state.token_ids) - state.num_placeholders:
                continue
            # Only the last launched step can be uncollected when another launches, and a request
            # samples one token per step: one placeholder, the chunk's last known token.
            assert state.num_placeholders == 1 and known_end == len(state.token_ids), "placeholder out of order"
            rows.append(inputs.last_token_index[i] - len(chunk.spec_token_ids))
            sources.append(self._last_sampled[1][chunk.request_id])
        if rows:
            tokens = self._last_sampled[0]
            inputs.input_ids[to_device(rows, self.device, torch.long)] = tokens[to_device(sources, self.device, torch.long)]

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.requests[request_id]
        return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids,
                           self._reseeded(state), state.eos_token_ids)

    def _prompt_logprobs(self, chunk, hidden: torch.Tensor, last_index: int):
        """Logprobs of the prompt tokens this chunk predicts: position p predicts token p + 1."""
        state = self.requests[chunk.request_id]
        first_index = last_index - chunk.num_tokens + 1
        end = min(chunk.start + chunk.num_tokens, len(state.prompt_token_ids) - 1)  # last position predicting a prompt token
        entries: list = [None] if chunk.start == 0 else []
        if end > chunk.start:
            rows = hidden[first_index:first_index + (end - chunk.start)]
            targets = to_device(state.token_ids[chunk.start + 1:end + 1], self.device, torch.long)
            logits = self.model.compute_logits(rows)
            entries += [t.to_dict() for t in compute_prompt_logprobs(logits, targets, state.params.prompt_logprobs)]
        return entries

    # -------------------------------------------------------------------- speculative decoding
    def _verify_drafts(self, chunks: list[StepChunk], last_indices: list[int], step: _QueuedForward,
                       result: RunnerResult, grammar: GrammarOutput | None) -> PendingVerdicts | None:
        """Verify the chunks' drafts from their last m + 1 rows (a graph's logits, or the head
        over the eager forward's hidden states); draft_verification.py says when the verdicts
        are taken."""
        index = [j for chunk, last in zip(chunks, last_indices) for j in range(last - len(chunk.spec_token_ids), last + 1)]
        rows = to_device(index, self.device, torch.long)
        logits = step.row_logits[rows] if step.row_logits is not None else self.model.compute_logits(step.hidden[rows])
        generators = [self._reseeded(self.requests[c.request_id]) for c in chunks]
        return verify_chunks(self.requests, chunks, logits, generators, grammar, result)

    @staticmethod
    def _reseeded(state: RunnerRequestState) -> torch.Generator | None:
        if state.generator is not None:
            # NOTE: reseeded from (seed, position) every step, plain sampling and verification
            # alike, so a seeded request draws the same tokens whatever it is batched with, and
            # again after a preemption and recompute.
            state.generator.manual_seed((state.params.seed * 1_000_003 + len(state.output_token_ids)) % 2**63)
        return state.generator

    @torch.inference_mode()
    def profile_verify_step(self, num_seqs: int, num_query: int, context: int = 128) -> float:
        """Seconds for one verify-shaped step: num_seqs sequences, each 1 token + num_query - 1
        drafts at `context` tokens of history, logits at every query token. Runs at start-up
        only: it writes garbage KV into the first blocks, which no request owns yet."""
        bs = self.block_size
        # Inside the pool and inside max_model_len: a graph's block tables are that wide.
        context = max(min(context, (self.num_blocks - 1) * bs - num_query, self._max_model_len() - num_query), 0)
        blocks = list(range(1, -(-(context + num_query) // bs) + 1))
        chunks = [StepChunk(f"profile-{i}", context, num_query, [blocks for _ in self.groups], True,
                            spec_token_ids=[0] * (num_query - 1)) for i in range(num_seqs)]
        token_ids = {c.request_id: [0] * (context + 1) for c in chunks}
        start = time.perf_counter()
        # The path a real step of this shape takes (a graph where one holds it), so adaptive
        # verification weighs what verification costs where it will run.
        step = self._queue_forward(chunks, token_ids, fill_placeholders=False)
        logits = (step.row_logits if step.row_logits is not None else step.logits if step.logits is not None
                  else self.model.compute_logits(step.hidden))
        logits.argmax(dim=-1).tolist()   # .tolist() waits for the device
        for chunk in chunks:   # throwaway requests: what the model took for them goes back
            release_model_state(chunk.model_state)
        return time.perf_counter() - start

    def supports_mtp(self) -> bool:
        """Whether the model carries a multi-token-prediction head (spec_decode/mtp.py)."""
        return hasattr(self.model, "propose_mtp") and getattr(self.model, "has_mtp", True)

    def propose_mtp(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """The model's drafts; it gets each request's model_state (what its forwards kept)."""
        states = {r.request_id: self.requests[r.request_id].model_state for r in requests if r.request_id in self.requests}
        return self.model.propose_mtp(requests, states)

