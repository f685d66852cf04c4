"""The KV connector seam: moves whole KV blocks between the device pool and a tier outside it.

vLLM's two-role shape. The scheduler side lives beside the scheduler and never sees a tensor; the
worker side lives in the model runner and never sees a Request. What crosses between them is the
plan's KVConnectorMetadata (loads and saves, as KVTransfer values) and, back, the ids of the
transfers that completed (RunnerResult.finished_kv_transfers). types/plan.py holds those types.

A step with connector work, as the scheduler side sees it:

    tier_tokens = sched.get_num_new_matched_tokens(hashes, group_ids, device_hit_tokens)
    ... allocate device blocks for those tokens, park the request in WAITING_FOR_KV ...
    sched.allocate_loads(request_id, hashes_of_those_blocks, {group_id: device_block_ids})
    sched.save_blocks(request_id, group_id, hashes, device_block_ids)   # newly full, computed blocks
    plan.kv_connector_metadata = sched.build_connector_meta()
    ...
    done = sched.on_transfers_finished(result.finished_kv_transfers)
    done.loaded: requests whose KV is now on the device; done.released: delayed frees to apply

and the worker side, inside a runner step:

    worker.start_transfers(meta)    # before the forward is queued: loads start on a side stream
    <the step's forward>
    worker.after_forward()          # saves start behind the forward, which wrote their blocks
    ...
    result.finished_kv_transfers = worker.finished_transfers()   # when the step is collected

What a tier may hold: only KV kinds that are persisted outside the device. Full attention is;
sliding-window KV never is (a hit rebuilds it by SWA Bounded Replay, kv_cache/manager.py).
Tiers live under kv_cache/store/ (host.py: host memory, `kv_offloading_size`; persistent.py: a
directory or Redis, `kv_store`, shared between instances).

A load may fail (a persistent store's entry gone or corrupt, the store down, a read past
kv_store_load_timeout_s). The worker then reports its id by `failed_transfers()` instead of
`finished_transfers()` (RunnerResult.failed_kv_transfers), the scheduler side gets both lists in
`on_transfers_finished`, and the request comes back in FinishedTransfers.failed: none of its
tier blocks are on the device, and it recomputes them.

Traffic class: save_blocks and allocate_loads take an optional `traffic_class` (the retention
class of kv_retention; None: "chat"), and `touch` restarts the retention of blocks a request used
from the device (a prefix hit there is a use too). The host tier ignores both.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.kv_cache.tensors import group_slots
from deepinfer.types.plan import KVConnectorMetadata, KVTransfer
from deepinfer.types.tier_stats import KVConnectorStats

if TYPE_CHECKING:
    import torch

    from deepinfer.kv_cache.specs import KVCacheGroup


# A tier entry's key: (group key, block hash). The block hash chain (types/block_hashes.py)
# already carries the model id and the tenant's cache_salt; the group key adds what makes the
# bytes differ for the same tokens that the chain does not carry (see group_key).
TierKey = tuple[bytes, bytes]


def group_key(group: KVCacheGroup, block_size: int, extra: bytes = b"") -> bytes:
    """What makes one group's block bytes differ from another's for the same block hash: the
    kind, its shape, the storage dtype (an fp8 cache never serves a bf16 one), the block size,
    the window, and which layers the group holds (groups of one spec hold different layers).
    `extra` is for what a later tier adds (a tensor-parallel rank, a model revision)."""
    signature = (group.spec.signature(block_size), group.layer_ids)
    h = hashlib.blake2b(repr(signature).encode(), digest_size=16)
    h.update(extra)
    return h.digest()


def group_kv_tensors(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], groups: Sequence[KVCacheGroup],
                     group: KVCacheGroup) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
    """The (K, V) tensors of a group's layers, each [num_blocks * block_size, kv_heads, head_dim]:
    the slots of its pool (kv_cache/tensors.py). The one place tiers address device KV."""
    return [kv_caches[i] for i in group_slots(list(groups), group)]


@dataclass
class FinishedTransfers:
    """What completed transfers mean to the scheduler (KVConnectorScheduler.on_transfers_finished)."""

    loaded: list[str]     # requests whose loads all completed: their KV is on the device now
    # Requests whose device blocks may be freed now: finished ones whose saves completed (the
    # delayed free), and ones whose loads were aborted while already copying.
    released: list[str]
    # Requests whose loads all ended and at least one failed: their loaded blocks hold nothing
    # usable (never published, never read by a forward). Their device blocks are no longer
    # written by any transfer; the scheduler frees or reuses them and recomputes the request.
    failed: list[str] = field(default_factory=list)


class KVConnectorScheduler(abc.ABC):
    """The scheduler side: an index of what the tier holds, and the transfers to queue.

    Block hashes are the request's chain (Request.block_hashes); group ids are KVCacheGroup ids.
    Everything here runs on the scheduler's thread, between steps."""

    block_size: int
    tier_name: str = "host"   # the `tier` label of its metrics: host | store
    # Saves are gathered into runs of this many blocks on a grid of the request's chain (a
    # persistent store's entries, kv_cache/store/runs.py): the caller hands each save's blocks
    # from its run's grid line on, with their positions, so that a run whose first blocks the
    # request took from a prefix hit is still whole.
    run_blocks: int = 1

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request_hashes: Sequence[bytes], group_ids: Sequence[int],
                                   num_device_tokens: int, traffic_class: str | None = None,
                                   next_hash: bytes | None = None) -> int:
        """How many tokens past `num_device_tokens` (the device's prefix hit, whole blocks) the
        tier holds, in whole blocks, for every persisted group among `group_ids`; 0 if none (or
        none of the groups is persisted). Only saves that completed count.

        Pass only the hashes of blocks the request may hit (the caller leaves at least one token
        to compute), and in `next_hash` the hash of the request's next block if it has one (a
        full block holding the token it must compute: a tier whose entries span several blocks
        may find the entry that ends there, and read it without using that block). No side
        effects: the scheduler may ask again for a request it could not admit. Count the query
        once, on admission, with `record_query`."""

    @abc.abstractmethod
    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's look-up: `num_tokens` asked for past the device hit, of which
        the tier held `num_hit_tokens`."""

    def touch(self, request_hashes: Sequence[bytes], group_ids: Sequence[int], traffic_class: str) -> None:
        """A request used these blocks from the device prefix cache: a persistent store
        restarts their retention under `traffic_class` (entries it does not hold are ignored).
        Tiers without retention do nothing."""

    @abc.abstractmethod
    def allocate_loads(self, request_id: str, block_hashes: Sequence[bytes],
                       device_block_ids: Mapping[int, Sequence[int]],
                       traffic_class: str | None = None, first_block: int = 0) -> list[KVTransfer]:
        """Queue loads of the blocks `block_hashes` (those get_num_new_matched_tokens just
        counted, from block `first_block` of the request's chain: the device's prefix) into
        `device_block_ids[group_id]`, one device block per hash for each persisted group (a
        tier of runs, run_blocks > 1, takes the request's hashes from `first_block` on, and
        fewer device blocks: the first ones); returns the transfers queued (also in the next
        build_connector_meta). The entries are pinned until their load completes or is aborted.

        Call it right after the look-up, with no save_blocks in between (saves may evict).
        `traffic_class`: the request's retention class; a hit restarts the entries' retention
        under it (persistent stores)."""

    @abc.abstractmethod
    def save_blocks(self, request_id: str, group_id: int, block_hashes: Sequence[bytes],
                    device_block_ids: Sequence[int], traffic_class: str | None = None,
                    positions: Sequence[int] | None = None) -> list[KVTransfer]:
        """Queue saves of blocks that became full and computed (by steps whose result has been
        applied), one device block per hash; blocks the tier holds or is saving already are
        skipped. A group whose kind is not persisted is refused: a no-op, counted in the stats.
        Returns the transfers queued (possibly none). The entries become loadable once their
        save completed (on_transfers_finished). `traffic_class`: the retention class the entries
        are written under (persistent stores; None: "chat"). `positions`: each block's index in
        the request's chain (a tier of runs, run_blocks > 1, gathers them into runs and queues
        the trailing shorter run when the request finishes; None: a whole prefix from block 0)."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """The loads and saves queued since the last call (then cleared): the plan's
        kv_connector_metadata. Once built, a transfer reaches the worker and will complete."""

    @abc.abstractmethod
    def on_transfers_finished(self, transfer_ids: Sequence[int],
                              failed_ids: Sequence[int] = ()) -> FinishedTransfers:
        """Apply RunnerResult.finished_kv_transfers (and failed_kv_transfers: loads that ended
        without filling their blocks): saved entries become loadable, loaded ones are unpinned.
        Returns the requests whose loads all completed, those whose loads failed, and the delayed
        frees that may be applied now. Unknown ids (transfers cancelled before they were built)
        are ignored."""

    @abc.abstractmethod
    def request_finished(self, request_id: str) -> bool:
        """A request finished (or is being dropped, or preempted). True: keep its device blocks
        until it is reported in FinishedTransfers.released (its saves, or loads already copying,
        have not completed: the delayed free). False: free them now. Loads not built yet are
        cancelled. Queue its last saves (save_blocks) first: afterwards it takes none (a tier of
        runs queues the runs it gathered here)."""

    @abc.abstractmethod
    def abort_loads(self, request_id: str) -> bool:
        """Cancel a request's loads (aborted or preempted while WAITING_FOR_KV); the tier's pins
        of loads not built yet are released at once. True: some loads already reached the
        worker; keep the request's device blocks until it is reported in
        FinishedTransfers.released (the copies still write them). False: nothing in flight."""

    @property
    @abc.abstractmethod
    def num_pending_transfers(self) -> int:
        """Transfers queued or in flight, not reported finished yet: while nonzero, the engine
        keeps stepping (an empty plan still polls the worker)."""

    @abc.abstractmethod
    def stats(self) -> KVConnectorStats:
        """A copy of the counters."""


class KVConnectorWorker(abc.ABC):
    """The worker side: copies blocks between the device KV tensors and the tier.

    Never blocks the step: transfers run on a side stream (CUDA) and are polled; on the CPU they
    are synchronous and reported at the next poll."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           groups: Sequence[KVCacheGroup], block_size: int) -> None:
        """The device KV tensors (ModelRunner.kv_caches) and their layer groups, once allocated."""

    @abc.abstractmethod
    def start_transfers(self, meta: KVConnectorMetadata) -> None:
        """At the start of a step, before its forward is queued. Loads start at once (behind
        the device work queued so far: an earlier step may still write blocks now reused);
        the scheduler guarantees this step's forward reads none of the blocks they fill.
        Saves wait for `after_forward`."""

    @abc.abstractmethod
    def after_forward(self) -> None:
        """The step's forward is queued (or the step has none): start its saves behind it, so
        they read blocks the forward has written."""

    # Layer-wise loads (kv_store_layerwise_load; vLLM's wait_for_layer_load): a tier may report a
    # load finished while its copies into the device blocks are still in flight, layer by layer.
    # The runner then calls wait_for_layer_load before each attention layer of a forward and
    # wait_for_loads after it (and instead of both around a forward without per-layer waits: a
    # CUDA graph, a model whose attention does not go through layers/attention/layer.py).
    @property
    def has_layer_loads(self) -> bool:
        """Copies of loads reported finished may still be in flight: the next forward must wait."""
        return False

    def wait_for_layer_load(self, layer_id: int) -> None:
        """Before attention layer `layer_id` touches its KV: that layer's pending copies are
        done, or the compute stream is ordered behind them."""

    def wait_for_loads(self) -> None:
        """Every pending copy is done, or the compute stream is ordered behind them."""

    @abc.abstractmethod
    def finished_transfers(self) -> list[int]:
        """Ids of transfers completed since the last call, without waiting for the device."""

    def failed_transfers(self) -> list[int]:
        """Ids of loads that ended without filling their device blocks, since the last call
        (RunnerResult.failed_kv_transfers). Never also in finished_transfers. A tier whose
        loads cannot fail (host memory) reports none."""
        return []

    @abc.abstractmethod
    def wait_all(self) -> None:
        """Start what is deferred and wait for every transfer (shutdown, tests). Their ids are
        still reported by the next finished_transfers."""

    def close(self, timeout_s: float | None = None) -> None:
        """Shutdown: finish (persistent stores: flush queued writes, within `timeout_s`) and
        stop any threads. Idempotent."""
