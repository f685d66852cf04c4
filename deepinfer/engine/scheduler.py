"""The scheduler: one rule, no prefill/decode phases.

Every request has `num_computed_tokens` and a target (`num_tokens`: prompt plus sampled output,
plus draft tokens later). Each step spends a token budget (`max_num_batched_tokens`) bringing
running requests closer to their target, then admits waiting requests while budget, sequence
slots and KV blocks last. A prompt longer than the budget is computed in chunks (chunked
prefill); a prefix-cache hit starts a request further along; a preempted request starts again
from zero and recomputes (its blocks are usually still cached, so that is mostly a hit).
A request with a structured-output grammar waits outside the queue (WAITING_FOR_GRAMMAR) while
its grammar compiles in a worker; `poll_grammars` moves it into the queue once compiled, so a
slow compile delays that request alone.
A prefix hit may resume before the end of the cached prefix: SWA Bounded Replay recomputes the
last tokens of it for the sliding-window layers (kv_cache/manager.py); those are tokens to
compute like any others. When a KV tier holds more of the prefix than the device, the request
waits outside the queue too (WAITING_FOR_KV) while its blocks load, and joins the front of the
queue once they have (engine/kv_tier.py); others are admitted meanwhile.
Speculative decoding (spec_decode/) is the same rule with a longer target: a generating request
may also compute draft tokens, which the runner verifies; after the step its num_computed_tokens
counts only the accepted ones, and KV blocks past its known tokens go back to the pool.
Overlapped scheduling (engine/overlapped_loop.py) plans step N+1 before step N's result is applied: a
request whose token is still being sampled on the device counts it as known
(`num_samples_in_flight`), so it is scheduled to compute that token's position, whose id the
runner takes from the device. A request stopped by that token is found one step late; the result
of its extra chunk is ignored.
A pooling request (an embedding) has its prompt as its target and is never sampled: the step
that computes its last prompt token returns its vector, and it finishes there.
Running requests use at most max_loras distinct LoRA adapters (lora/scheduling.py).
What the runner learns of a request is sent once (NewRequestData, with its block tables) and
then as diffs (CachedRequestData, only when its tables changed; types/block_tables.py keeps the
record), and `schedule()` returns the plan final: nothing is added to it afterwards.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_tier import KVTierLink
from deepinfer.engine.stop_rules import at_length_limit, stop_status
from deepinfer.kv_cache.manager import KVCacheManager, PrefixHit
from deepinfer.lora.scheduling import AdapterAdmission
from deepinfer.multimodal.encoder_cache import EncoderScheduler
from deepinfer.sample.structured.grammar import GrammarState, RequestGrammar
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.types.block_tables import RunnerBlockTables
from deepinfer.types.plan import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerResult,
    ScheduledChunk,
    SchedulerPlan,
)
from deepinfer.types.request import Request, RequestStatus


@dataclass
class _PartialPlan:
    """The plan `schedule` is building: what each phase has added, and the token budget left."""

    budget: int
    drafts: dict[str, list[int]]          # proposed drafts by request (none: not speculating)
    chain: int                            # verify steps the plan may run back to back (1: none)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)    # requests with a chunk: never preempted

    def add(self, chunk: ScheduledChunk) -> None:
        """A request's chunk, its known tokens and drafts taken from the budget."""
        self.chunks.append(chunk)
        self.scheduled.add(chunk.request_id)
        self.budget -= chunk.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 spec: SpeculativeDecoder | None = None, kv_tier: KVTierLink | None = None,
                 images: EncoderScheduler | None = None, max_loras: int | None = None) -> None:
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs max_num_seqs and max_num_batched_tokens set "
                             "(EngineCore fills unset ones from the platform)")
        self.config = config
        self.spec = spec
        # Requests whose KV was allocated ahead for a verify chain by a plan not yet applied.
        self._allocated_ahead: set[str] = set()
        self.kv = kv_manager
        self.kv_tier = kv_tier               # a KV tier behind the connector, or None
        self.images = images                 # a model that reads images: multimodal/encoder_cache.py
        self.max_loras = max_loras           # distinct LoRA adapters running at once; None: LoRA off
        self.kv_events = None                # a kv_cache.events.KVEventSink, or None (no events)
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []     # kept sorted by the policy's key
        self.running: list[Request] = []     # in admission order
        self.waiting_for_grammar: list[Request] = []   # compiling; not schedulable yet
        self.waiting_for_kv: list[Request] = []        # a tier loads their prefix; blocks held
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._finished_ids: list[str] = []   # told to the runner in the next plan
        # kv_role=prefill: finished requests' last outputs, held until their KV is in the store.
        self._held_outputs: dict[str, EngineCoreOutput] = {}
        self.runner_tables = RunnerBlockTables()   # the requests the runner holds, and their tables
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_order = next(self._arrivals)
        self.requests[request.request_id] = request
        if request.grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            self._enqueue(request)

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request in self.waiting:
                self.waiting.remove(request)
            if request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            loading = request in self.waiting_for_kv
            if loading:
                self.waiting_for_kv.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED, loading=loading)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort"))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar or self.waiting_for_kv
                    or (self.kv_tier is not None and self.kv_tier.busy))

    def poll_grammars(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar compiled; fail those whose compile failed or timed out."""
        outputs = []
        for request in list(self.waiting_for_grammar):
            state = request.grammar.poll()
            if state is GrammarState.COMPILING:
                continue
            self.waiting_for_grammar.remove(request)
            if state is GrammarState.READY:
                request.status = RequestStatus.WAITING
                self._enqueue(request)
            else:
                request.error = request.grammar.error
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                                error=request.error))
        return outputs

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            self.waiting.append(request)
            self.waiting.sort(key=lambda r: r.sort_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    # ------------------------------------------------------------------------------- schedule
    def schedule(self, speculate: bool = True) -> SchedulerPlan:
        """The next step's plan. speculate=False: no drafts this step (the engine overlaps it
        with the step in flight, whose tokens the drafts would follow)."""
        partial = self._start_plan(speculate)
        self._schedule_running(partial)
        self._schedule_waiting(partial)
        return self._build_plan(partial)

    def _start_plan(self, speculate: bool) -> _PartialPlan:
        """The step's budget, and the drafts the speculative decoder proposes for running
        requests within what their known tokens leave of it."""
        budget = self.config.max_num_batched_tokens
        drafts: dict[str, list[int]] = {}
        if self.spec is not None and self.running and speculate:
            base = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
            drafts = self.spec.plan(self.running, budget - base, base)
        # Verify steps this plan may run back to back (worker/spec/verify_chain.py): lowered to what
        # every chunk allows, 1 (none) as soon as one does not qualify.
        chain = self.spec.config.verify_chain if drafts else 1
        return _PartialPlan(budget, drafts, chain)

    def _schedule_running(self, partial: _PartialPlan) -> None:
        """1. Running requests, oldest first; preempt from the back when blocks run out."""
        i = 0
        while i < len(self.running) and partial.budget > 0:
            request = self.running[i]
            num_new = min(self._capped(self._target(request) - request.num_computed_tokens), partial.budget)
            if self.images is not None:   # an image whole in one chunk, within the encoder budget
                num_new = self.images.fit(request, request.num_computed_tokens, num_new, partial.budget)
            # A token in flight that is the request's last: nothing more to compute for it.
            if num_new <= 0 or (request.num_samples_in_flight
                                and at_length_limit(request, self.max_model_len, request.num_samples_in_flight)):
                i += 1
                continue
            spec = self._allocate_running(partial, request, num_new)
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank, same index is the next request
            # Never preempted later in this schedule (victims exclude scheduled requests), so the
            # diff and the chunk reach a runner that still holds the request.
            diffs = self.runner_tables.diff(request.request_id, request.block_ids)
            if diffs is not None:
                partial.cached_requests.append(CachedRequestData(request.request_id, diffs))
            partial.add(self._chunk(request, num_new, spec))
            i += 1

    def _allocate_running(self, partial: _PartialPlan, request: Request, num_new: int) -> list[int]:
        """Blocks for a running request's chunk of `num_new` known tokens; returns the drafts it
        verifies. A chain's later steps write KV into blocks allocated now, for the worst case
        (every draft accepted at every step); the blocks past the accepted tokens go back in
        update. Without a chain, drafts where they fit; the known tokens, preempting for them."""
        spec = partial.drafts.get(request.request_id, [])[:partial.budget - num_new]
        steps = self._chain_steps(request, num_new, partial.chain)
        if steps > 1 and self.kv.allocate(request, steps * (self.spec.k + 1)):
            partial.chain = steps
            self._allocated_ahead.add(request.request_id)   # trimmed in update, chained or not
            return spec
        partial.chain = 1
        # Drafts are optional: with no room for them, verify none rather than preempt for them.
        if spec and self.kv.allocate(request, num_new + len(spec)):
            return spec
        while not self.kv.allocate(request, num_new):
            victim = self._pick_victim(exclude=partial.scheduled)
            self._preempt(victim)
            if victim is request:
                break
        return []

    def _schedule_waiting(self, partial: _PartialPlan) -> None:
        """2. Waiting requests in policy order, while budget, slots and blocks last (and LoRA adapter slots)."""
        adapters = AdapterAdmission(self.max_loras, self.running)
        passed = 0   # waiting requests at the front passed over for want of an adapter slot
        while len(self.waiting) > passed and partial.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[passed]
            if not adapters.admits(request):
                passed += 1
                continue
            if request.num_tokens_in_flight:
                # Preempted while a step of it is still in flight: readmit it once that step's
                # result has been applied (and ignored), so no stale result meets the new chunks.
                break
            allocated = self._allocate_waiting(request, partial)
            if allocated is None:
                break
            num_new, hit = allocated
            self.waiting.pop(passed)
            if hit is not None and hit.num_load_blocks:
                # Parked while the tier loads its blocks; others are admitted meanwhile.
                self.kv_tier.start_loads(request, hit)
                request.status = RequestStatus.WAITING_FOR_KV
                self.waiting_for_kv.append(request)
                continue
            self._admit(partial, request, num_new)
            adapters.admitted(request)

    def _allocate_waiting(self, request: Request, partial: _PartialPlan) -> tuple[int, PrefixHit | None] | None:
        """Blocks for a waiting request's first chunk: (tokens it computes, its prefix hit; None
        when a tier loaded its prefix already), or None: it waits, and so do those behind it.
        Under the priority policy a lower-priority running request may be preempted for it."""
        if request.kv_loaded:   # a tier loaded its prefix: its blocks are in place
            num_new = self._first_chunk(request, request.num_computed_tokens, partial.budget)
            if num_new is None or not self.kv.allocate(request, num_new):
                return None
            return num_new, None
        while True:
            tier = (functools.partial(self.kv_tier.lookup, request_id=request.request_id,
                                      request_hashes=request.block_hashes, traffic_class=request.traffic_class)
                    if self.kv_tier is not None and not request.skip_kv_tier else None)
            hit = self.kv.find_prefix_hit(request, tier)
            num_new = self._first_chunk(request, hit.num_computed_tokens, partial.budget)
            if num_new is None:
                return None
            if self.kv.allocate(request, num_new, hit):
                break
            if not self._preempt_for(request, partial.scheduled):
                return None
        if request.status is RequestStatus.WAITING:  # first admission, not a resume
            self.kv.record_prefix_query(request.num_tokens, hit)
            if self.kv_tier is not None:
                self.kv_tier.record_query(request, hit)
            # Tokens not computed: replayed tokens are computed, so they do not count.
            request.num_cached_tokens = hit.num_computed_tokens
        request.num_computed_tokens = hit.num_computed_tokens
        request.window_floor, request.write_floor = hit.window_floor, hit.write_floor
        return num_new, hit

    def _first_chunk(self, request: Request, start: int, budget: int) -> int | None:
        """Tokens of a waiting request's first chunk (from `start`) within the budget; None when
        the rest of its prompt must fit in one step (chunked prefill off) and does not, or when
        its next image cannot be computed this step."""
        num_new = self._capped(request.num_tokens - start)
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if self.images is not None:
            num_new = self.images.fit(request, start, num_new, budget)
        return num_new or None

    def _capped(self, num_new: int) -> int:
        """long_prefill_token_threshold (vLLM's): a long prompt's chunk is cut to it, so that one
        request cannot take a whole step's budget (0: no cap)."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if 0 < cap < num_new else num_new

    def _admit(self, partial: _PartialPlan, request: Request, num_new: int) -> None:
        """A waiting request starts running: the runner learns it whole, with its first chunk."""
        request.kv_loaded = False
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.monotonic()
        self.running.append(request)
        partial.new_requests.append(NewRequestData(
            request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
            request.sampling_params, request.eos_token_ids,
            self.runner_tables.new_request(request.request_id, request.block_ids),
            window_floor=request.window_floor, write_floor=request.write_floor, pooling=request.pooling,
            lora=request.lora))
        partial.add(self._chunk(request, num_new))

    def _build_plan(self, partial: _PartialPlan) -> SchedulerPlan:
        """3. The plan, final: the step's chunks, the requests the runner drops, the KV tier's
        transfers, and the verify chain if every chunk can take it."""
        new_requests, chunks, chain = partial.new_requests, partial.chunks, partial.chain
        finished, self._finished_ids = self._finished_ids, []
        if new_requests or not any(c.spec_token_ids for c in chunks):
            chain = 1   # a prefill chunk needs the plain path; without drafts there is nothing to verify
        elif self.spec.method.adaptive and not all(c.spec_token_ids for c in chunks):
            # Every request of a chain verifies as many drafts as the one with most: only where
            # the policy found drafts worth verifying for every request at this partial.
            chain = 1
        return SchedulerPlan(new_requests, partial.cached_requests, chunks, finished,
                             self.config.max_num_batched_tokens - partial.budget,
                             self.kv_tier.build_meta() if self.kv_tier is not None else None,
                             verify_chain=chain, images=self.images.take_plan() if self.images is not None else None)

    def _chain_steps(self, request: Request, num_new: int, chain: int) -> int:
        """Verify steps of a chain this request can join, at most `chain` (1: none): it is
        generating, greedy without logprobs or a grammar (the runner checks the rest of plain
        greedy), and every step's k + 1 positions fit inside max_model_len. No more steps than
        its remaining max_tokens take at the mean tokens a verify step has emitted: steps past
        its end are computed for nothing."""
        params = request.sampling_params
        if (chain < 2 or num_new != 1 or request.grammar is not None or params.temperature != 0
                or params.logprobs is not None or request.num_tokens - request.num_computed_tokens != 1):
            return 1
        remaining = request.max_tokens - request.num_output_tokens
        per_step = max(self.spec.stats.mean_accepted_length, 1.0)
        return min(chain, -int(-remaining // per_step),
                   (self.max_model_len - request.num_computed_tokens) // (self.spec.k + 1))

    @staticmethod
    def _target(request: Request) -> int:
        """Tokens the request has, counting those still being sampled on the device."""
        return request.num_tokens + request.num_samples_in_flight

    def _chunk(self, request: Request, num_new: int, spec: list[int] | None = None) -> ScheduledChunk:
        start = request.num_computed_tokens
        request.spec_token_ids = spec or []
        chunk = ScheduledChunk(
            request_id=request.request_id,
            start=start,
            num_tokens=num_new + len(request.spec_token_ids),   # drafts ride after the known tokens
            # A pooling request is never sampled: its last chunk returns its vector instead.
            sample=request.pooling is None and start + num_new == self._target(request),
            prompt_logprobs=(request.sampling_params.prompt_logprobs is not None
                             and start < request.num_prompt_tokens),
            spec_token_ids=request.spec_token_ids,
        )
        if self.images is not None:
            self.images.commit(request, start, num_new)
        # Drafts count as computed only once accepted (update); the known tokens count now.
        request.num_computed_tokens += num_new
        request.num_tokens_in_flight += num_new
        request.num_samples_in_flight += chunk.sample
        return chunk

    def _pick_victim(self, exclude: set[str]) -> Request:
        """The running request to preempt: lowest priority, then latest arrival."""
        candidates = [r for r in self.running if r.request_id not in exclude] or self.running
        return max(candidates, key=lambda r: r.sort_key)

    def _preempt_for(self, request: Request, scheduled: set[str]) -> bool:
        """Priority policy only: free blocks by preempting a strictly lower-priority request."""
        if self.config.policy != "priority":
            return False
        candidates = [r for r in self.running
                      if r.request_id not in scheduled and r.sort_key > request.sort_key]
        if not candidates:
            return False
        self._preempt(max(candidates, key=lambda r: r.sort_key))
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: free all blocks; the request starts over when resumed."""
        self.running.remove(request)
        self._release_kv(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.window_floor = request.write_floor = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._drop_from_runner(request.request_id)
        self._enqueue(request, front=True)

    def _drop_from_runner(self, request_id: str) -> None:
        if self.runner_tables.forget(request_id):
            self._finished_ids.append(request_id)

    # --------------------------------------------------------------------------------- update
    def update(self, plan: SchedulerPlan, result: RunnerResult) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        if self.kv_tier is not None:
            outputs += self._apply_kv_transfers(result)
        # Grammars advance by their request's one sampled token in one batch call after the loop
        # (nothing in the loop reads a matcher); a request verifying drafts advances in order.
        grammars, grammar_tokens = [], []
        for chunk in plan.chunks:
            ahead = chunk.request_id in self._allocated_ahead
            if ahead:   # blocks allocated for a chain (schedule): trimmed below either way
                self._allocated_ahead.discard(chunk.request_id)
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue  # finished or aborted while the step ran
            num_spec = len(chunk.spec_token_ids)
            request.num_tokens_in_flight -= chunk.num_tokens - num_spec
            request.num_samples_in_flight -= chunk.sample
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted after this step was scheduled: it recomputes instead
            # In a chained plan even a request without drafts of its own may have verified some
            # (the chain's later steps draft on the device), and it holds blocks allocated ahead.
            verifies = bool(num_spec) or plan.verify_chain > 1
            if not verifies:
                self._publish(request)
            if request.pooling is not None:   # done once its last prompt chunk has run
                if chunk.start + chunk.num_tokens == request.num_prompt_tokens:
                    outputs.append(self._finish_pooled(request, result.pooled.get(chunk.request_id), now))
                continue
            prompt_logprobs = result.prompt_logprobs.get(chunk.request_id)
            if not chunk.sample:
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(chunk.request_id, [], prompt_logprobs=prompt_logprobs))
                continue
            new_tokens: list[int] = []
            finish: RequestStatus | None = None
            sampled = result.sampled_token_ids.get(chunk.request_id, [])
            for token_id in sampled:
                request.append_output_token(token_id)
                if request.grammar is not None:   # the sampled token was inside the mask
                    if num_spec:
                        request.grammar.accept(token_id)
                    else:
                        grammars.append(request.grammar)
                        grammar_tokens.append(token_id)
                new_tokens.append(token_id)
                finish = stop_status(request, token_id, self.max_model_len)
                if finish is not None:
                    break
            if verifies:
                # The runner returns the accepted drafts then one token of its own: the KV of
                # exactly those drafts is valid (same tokens at the same positions); the rest
                # was computed for rejected tokens and is dropped. A chain returns that of each
                # of its steps back to back: every token but the last has its KV computed.
                num_accepted = max(len(sampled) - 1, 0)
                steps = result.verify_steps.get(chunk.request_id) or [(num_spec, num_accepted)]
                for num_verified, num_step_accepted in steps:
                    if num_verified:
                        self.spec.observe(request.request_id, num_verified, num_step_accepted)
                request.spec_token_ids = []
                if finish is None:
                    request.num_computed_tokens += num_accepted
                    self._publish(request)
                    self.kv.free_tail(request)
                    self.runner_tables.cut(request.request_id, request.block_ids)
            elif ahead and finish is None:   # allocated for a chain that the plan did not run
                self.kv.free_tail(request)
                self.runner_tables.cut(request.request_id, request.block_ids)
            if request.times.first_token is None and new_tokens:
                request.times.first_token = now
            logprobs = result.logprobs.get(chunk.request_id)
            output = EngineCoreOutput(
                chunk.request_id, new_tokens,
                new_logprobs=logprobs[:len(new_tokens)] if logprobs else None,
                prompt_logprobs=prompt_logprobs,
                finish_reason=finish.value if finish else None,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
            )
            if finish is not None:
                self._finish(request, finish)
                if self.kv_tier is not None and self.kv_tier.answer_when_saved \
                        and self.kv_tier.is_parked(request.request_id):
                    # A prefill instance answers once the prompt's KV is in the store, so the
                    # decode instance the router asks next finds it (CacheConfig.kv_role).
                    self._held_outputs[request.request_id] = output
                    continue
            outputs.append(output)
        if grammars:
            RequestGrammar.accept_batch(grammars, grammar_tokens)
        return outputs

    def _finish_pooled(self, request: Request, pooled: bytes | None, now: float) -> EngineCoreOutput:
        """A pooling request's vector is in: it finishes and frees its blocks (those it published
        stay cached for later prefix hits: their KV is exact whatever the request's kind)."""
        request.times.first_token = now
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        if pooled is None:   # a runner that lost the request's state: a bug, reported on this request only
            return EngineCoreOutput(request.request_id, [], finish_reason="abort", error="no pooled output")
        return EngineCoreOutput(request.request_id, [], finish_reason="stop",
                                num_cached_tokens=request.num_cached_tokens, pooled=pooled)

    def _publish(self, request: Request) -> None:
        """Blocks the last step completed become hits, and a tier saves them."""
        published = self.kv.cache_computed_blocks(request)
        if self.kv_events is not None:
            self.kv_events.device_published(request, published, self.kv)
        if self.kv_tier is not None:
            self.kv_tier.save(request, published)

    def _apply_kv_transfers(self, result: RunnerResult) -> list[EngineCoreOutput]:
        """Requests whose tier loads completed go to the front of the queue, blocks in place; those
        whose loads failed (a corrupt entry, a store gone or timed out) go there too, from zero, and
        ask the tier again only where it may hold a shorter prefix now (KVTierLink.may_retry: a
        store drops bad entries). Returns the held last outputs of finished requests whose saves
        are now written (kv_role=prefill)."""
        loaded, failed, released = self.kv_tier.poll(result)
        answered = [self._held_outputs.pop(r) for r in released if r in self._held_outputs]
        for request_id in loaded + failed:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
                continue
            self.waiting_for_kv.remove(request)
            if request_id in failed:
                self.kv.free(request)   # nothing of it was published: loaded blocks publish after a step
                request.num_computed_tokens = 0
                request.window_floor = request.write_floor = 0
                request.skip_kv_tier = not self.kv_tier.may_retry(request_id)
            else:
                request.kv_loaded = True
            request.status = RequestStatus.WAITING   # a failed load counts its new look-up afresh
            self._enqueue(request, front=True)
        return answered

    def _release_kv(self, request: Request, loading: bool = False) -> None:
        if self.kv_tier is not None:
            self.kv_tier.release(request, loading=loading)   # parked while a transfer uses them
        else:
            self.kv.free(request)

    def _finish(self, request: Request, status: RequestStatus, loading: bool = False) -> None:
        if self.spec is not None:
            self.spec.forget(request.request_id)   # e.g. aborted while its drafts were in flight
        request.spec_token_ids = []
        request.status = status
        request.times.finished = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        self._release_kv(request, loading)
        self._drop_from_runner(request.request_id)
        del self.requests[request.request_id]

    # -------------------------------------------------------------------------------- metrics
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self.waiting_for_grammar)
