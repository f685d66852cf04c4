"""The scheduler's use of a KV connector (kv_cache/connector.py): what it asks a tier at
admission, the loads of requests parked in WAITING_FOR_KV, the saves of newly computed blocks,
and the delayed free of blocks a transfer still reads or writes.

The scheduler calls it at five points:
  lookup(request)             inside the prefix look-up: blocks the tier holds past the device's
                              (a persistent store's hit may be declined: recomputing it is faster,
                              engine/kv_load_policy.py)
  start_loads(request, hit)   after allocation: queue the loads; the request waits outside the queue
  save(request, published)    after a step published blocks: queue their saves
  release(request)            a request finishes, is preempted or aborted: free its blocks now,
                              or park them until the tier's transfers on them complete
  poll(result)                each result: loads that completed (their requests become
                              schedulable), loads that failed (their requests start over) and
                              parked blocks that may be freed

A request whose load from a persistent store failed starts over and is looked up once more
(may_retry): a bad or missing entry was dropped by then, so the store answers with the prefix
before it, which loads; an answer no shorter than the failed one (a store that is slow or down,
not damaged) is declined, and the request recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from deepinfer.engine.kv_load_policy import KVLoadPolicy
from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID
from deepinfer.kv_cache.connector import KVConnectorScheduler
from deepinfer.kv_cache.manager import KVCacheManager, PrefixHit
from deepinfer.types.plan import SKIP_BLOCK, KVConnectorMetadata, RunnerResult, SchedulerPlan
from deepinfer.types.request import Request
from deepinfer.types.tier_stats import KVConnectorStats


class KVTierLink:
    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager, kv_role: str = "both",
                 load_policy: str = "always") -> None:
        self.connector = connector
        self.kv = kv
        # Prefill/decode disaggregation (CacheConfig.kv_role): a decode instance writes nothing to
        # the tier; a prefill instance's requests are answered once their saves are written
        # (the worker side reports them finished only then, and the scheduler holds the answer).
        self.saves = kv_role != "decode"
        self.answer_when_saved = kv_role == "prefill"
        self._persisted = [g for g in kv.groups if g.spec.persisted]
        self._persisted_ids = [g.group_id for g in self._persisted]
        # Block tables kept past their request's end (or preemption) while transfers use them.
        self._parked: dict[str, list[list[list[int]]]] = {}
        # CacheConfig.kv_store_load_policy. Only a persistent store's hits may be declined: the host
        # tier copies from RAM, always faster than computing. A decode instance always loads: the
        # store is how its prompts' KV arrives, and computing prompts is the prefill instances' job.
        self.load_policy = (KVLoadPolicy(kv.block_size) if load_policy == "auto" and connector.tier_name == "store"
                            and kv_role != "decode" else None)
        # (request id, blocks, load?) of the last hit decided: the scheduler asks again for a
        # request it could not admit yet, and that hit keeps its answer, counted once.
        self._decided: tuple[str, int, bool] | None = None
        # Requests whose load failed, with the end (in blocks) of what they tried to load: their
        # next look-up is taken only if shorter (a damaged entry was dropped since).
        self._failed_ends: dict[str, int] = {}
        self._loading: dict[str, int] = {}   # request id -> the end (in blocks) of its load in flight
        self._probes = 0

    # ---------------------------------------------------------------------------- admission
    def lookup(self, hashes: list[bytes], num_device_blocks: int, request_id: str | None = None,
               request_hashes: list[bytes] | None = None, traffic_class: str | None = None) -> int:
        """Blocks past the device's `num_device_blocks` the tier holds of `hashes` (those the
        request may hit); `request_hashes`: all of the request's, of which the one after them
        may end a tier's entry (a run the request's own prompt stored)."""
        bs = self.kv.block_size
        more = request_hashes is not None and len(request_hashes) > len(hashes)
        n = self.connector.get_num_new_matched_tokens(hashes, self._persisted_ids, num_device_blocks * bs,
                                                      next_hash=request_hashes[len(hashes)] if more else None) // bs
        failed_end = self._failed_ends.get(request_id) if request_id is not None else None
        if failed_end is not None and num_device_blocks + n >= failed_end:
            n = 0   # the store answers as before its load failed: not damaged, slow or down
        if not n or self.load_policy is None:
            return n
        decided = self._decided
        if request_id is not None and decided is not None and decided[:2] == (request_id, n):
            return n if decided[2] else 0
        load = self.load_policy.should_load(n, num_device_blocks)
        self._decided = None if request_id is None else (request_id, n, load)
        if not load and self.load_policy.take_probe():
            self._probe(request_hashes or hashes, num_device_blocks, n, traffic_class)
        return n if load else 0   # 0: the scheduler computes the prefix

    def _probe(self, hashes: list[bytes], num_device_blocks: int, n: int, traffic_class: str | None) -> None:
        """Read a declined hit's entries into no device block (KVLoadPolicy.take_probe): a load
        sample that no request waits for. Reported under an id of its own, which no request has."""
        self._probes += 1
        probe_id = f"kv-load-probe-{self._probes}"
        transfers = self.connector.allocate_loads(probe_id, hashes[num_device_blocks:],
                                                  {g.group_id: [SKIP_BLOCK] * n for g in self._persisted},
                                                  traffic_class=traffic_class, first_block=num_device_blocks)
        if transfers:
            self.load_policy.load_started(probe_id, n, time.perf_counter())

    def may_retry(self, request_id: str) -> bool:
        """A load of the request failed: whether it is looked up once more (a persistent
        store's, whose bad entries the load dropped) rather than recomputed without the tier."""
        return self.connector.tier_name == "store" and request_id in self._failed_ends

    def record_query(self, request: Request, hit: PrefixHit) -> None:
        """Once, at a request's first admission: the tokens asked of the tier and those it held."""
        bs = self.kv.block_size
        self.connector.record_query(hit.num_tier_queried_blocks * bs, hit.num_load_blocks * bs)
        # A use of the prefix the device held is a use of its stored copies: their retention restarts.
        on_device = len(hit.block_ids[self._persisted_ids[0]]) if self._persisted_ids and hit.block_ids else 0
        if on_device:
            self.connector.touch(request.block_hashes[:on_device], self._persisted_ids, request.traffic_class)

    def start_loads(self, request: Request, hit: PrefixHit) -> None:
        """Queue the loads of a hit's tier blocks into the device blocks just allocated for them."""
        start, end = hit.load_start, hit.load_start + hit.num_load_blocks
        # A tier of runs reads whole entries: it names them from the request's hashes past the hit.
        hashes = request.block_hashes[start:] if self.connector.run_blocks > 1 else request.block_hashes[start:end]
        self.connector.allocate_loads(request.request_id, hashes,
                                      {g.group_id: request.block_ids[g.group_id][start:end] for g in self._persisted},
                                      traffic_class=request.traffic_class, first_block=start)
        self._loading[request.request_id] = end
        if self.load_policy is not None:
            self.load_policy.load_started(request.request_id, hit.num_load_blocks, time.perf_counter())

    def observe_step(self, plan: SchedulerPlan, queued_at: float) -> None:
        """A step's result arrived (the engine core; perf_counter times): a prefill cost sample."""
        if self.load_policy is not None:
            self.load_policy.observe_step(plan, queued_at, time.perf_counter())

    def stats(self) -> KVConnectorStats:
        stats = self.connector.stats()
        if self.load_policy is not None:
            stats.declined_loads = self.load_policy.declined_blocks
        return stats

    # -------------------------------------------------------------------------------- saves
    def save(self, request: Request, published: range) -> None:
        if not published or not self.saves:
            return
        hashes = request.block_hashes
        # A tier of runs gets the blocks from the run's grid line on: those before `published`
        # (computed earlier, or taken from a prefix hit) complete the run with the new ones.
        first = published.start - published.start % self.connector.run_blocks
        for group in self._persisted:
            ids = request.block_ids[group.group_id]
            blocks = [i for i in range(first, published.stop) if ids[i] != NULL_BLOCK_ID]
            if blocks:
                self.connector.save_blocks(request.request_id, group.group_id, [hashes[i] for i in blocks],
                                           [ids[i] for i in blocks], traffic_class=request.traffic_class,
                                           positions=blocks)

    def build_meta(self) -> KVConnectorMetadata:
        return self.connector.build_connector_meta()

    # ----------------------------------------------------------------------- freeing blocks
    def release(self, request: Request, *, loading: bool = False) -> None:
        """Free the request's blocks, or park them while a transfer still uses them. `loading`:
        the request is parked in WAITING_FOR_KV (its loads are cancelled)."""
        if loading and self.load_policy is not None:
            self.load_policy.load_dropped(request.request_id)
        self._loading.pop(request.request_id, None)
        if not loading:   # finished (or preempted: it starts over with a look-up of its own)
            self._failed_ends.pop(request.request_id, None)
        in_flight = (self.connector.abort_loads(request.request_id) if loading
                     else self.connector.request_finished(request.request_id))
        if in_flight:
            self._parked.setdefault(request.request_id, []).append(request.block_ids)
            request.block_ids = [[] for _ in self.kv.groups]
            request.num_published_blocks = 0
        else:
            self.kv.free(request)

    def poll(self, result: RunnerResult) -> tuple[list[str], list[str], list[str]]:
        """Apply the transfers a result reports finished or failed; returns the requests whose
        loads completed, those whose loads failed (no transfer writes their blocks any more:
        they are recomputed), and those whose parked blocks were freed (their transfers done)."""
        done = self.connector.on_transfers_finished(result.finished_kv_transfers, result.failed_kv_transfers)
        for request_id in done.loaded:
            self._loading.pop(request_id, None)
        for request_id in done.failed:
            end = self._loading.pop(request_id, None)
            if end is not None:
                self._failed_ends[request_id] = end
        if self.load_policy is not None and (done.loaded or done.failed):
            now = time.perf_counter()
            for request_id in done.loaded:
                self.load_policy.load_finished(request_id, True, now)
            for request_id in done.failed:
                self.load_policy.load_finished(request_id, False, now)
        released = []
        for request_id in done.released:
            tables_list = self._parked.pop(request_id, [])
            for tables in tables_list:
                for group, ids in zip(self.kv.groups, tables):
                    self.kv.pool_of(group).free(ids[::-1])
            if tables_list:
                released.append(request_id)
        return done.loaded, done.failed, released

    def is_parked(self, request_id: str) -> bool:
        """Whether a finished request's blocks wait for its transfers (its saves, on a prefill instance)."""
        return request_id in self._parked

    @property
    def busy(self) -> bool:
        """Transfers queued or in flight: the engine keeps stepping to poll them."""
        return self.connector.num_pending_transfers > 0 or bool(self._parked)

    def blocks_parked(self) -> Sequence[str]:
        return list(self._parked)
