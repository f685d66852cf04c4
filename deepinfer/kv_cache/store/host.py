"""The host-memory KV tier (vLLM's `kv_offloading_size`, in GiB): both sides of the connector.

Storage. Persisted groups with the same page layout (layers per group, bytes per page) share a
pool of host slots; a slot holds one block of one group: [layers, K/V, page]. All pools get the
same number of slots per group they serve (a tier hit needs the block in every persisted group,
so an uneven split would only strand slots): with one persisted group, the tier holds
kv_offloading_size / (bytes of one block of that group) blocks.

Scheduler side (HostTierScheduler): an index TierKey -> (pool, slot). An entry is pending from
its save's queueing until the save completed, and only then loadable; it is pinned while loads
read it. Ready, unpinned entries are evictable, least recently used first. Pending and pinned
entries are never evicted: a save overwriting a slot a load still reads would corrupt it.

Worker side (HostTierWorker): one tensor per pool, [slots, layers, 2, page words]. A transfer is
a few batched index ops per layer (index_select from one side, index_copy_ into the other) on
byte-exact integer views, so any storage dtype, fp8 included, moves bit for bit. On CUDA they run
on a side stream against a device view of the page-locked host memory (platforms/host_memory.py),
and an event per transfer is polled; on the CPU they run at once and are reported at the next
poll.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.kv_cache.connector import (
    FinishedTransfers,
    KVConnectorWorker,
    TierKey,
    group_key,
    group_kv_tensors,
)
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store.transfers import TierSchedulerBase, _Transfer
from deepinfer.platforms.host_memory import HostBuffer
from deepinfer.platforms.transfer import to_device
from deepinfer.types.plan import KVConnectorMetadata, KVTransfer
from deepinfer.types.tier_stats import KVConnectorStats

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class TierPool:
    """Host slots of one page layout, shared by the persisted groups that have it."""

    group_ids: tuple[int, ...]
    num_layers: int           # layers per group
    page_bytes: int           # one layer's K (or V) of one block
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * 2 * self.page_bytes


def plan_pools(groups: Sequence[KVCacheGroup], block_size: int, size_bytes: int) -> list[TierPool]:
    """How `size_bytes` of host memory is split into pools of slots (both sides compute it)."""
    layouts: dict[tuple[int, int], list[int]] = {}
    for g in groups:
        if g.spec.persisted:
            layouts.setdefault((len(g.layer_ids), g.spec.page_bytes(block_size) // 2), []).append(g.group_id)
    bytes_per_block = sum(len(ids) * layers * 2 * page for (layers, page), ids in layouts.items())
    if not bytes_per_block:
        raise ValueError("no layer group's KV kind may be persisted (sliding-window KV never is)")
    per_group = size_bytes // bytes_per_block
    if per_group < 1:
        raise ValueError(f"kv_offloading_size holds no block: one block of every persisted layer group "
                         f"takes {bytes_per_block} bytes, the tier has {size_bytes}")
    return [TierPool(tuple(ids), layers, page, per_group * len(ids)) for (layers, page), ids in layouts.items()]


# ---------------------------------------------------------------------------- scheduler side
@dataclass
class _Entry:
    pool: int
    slot: int
    ready: bool = False       # its save completed: loadable
    pins: int = 0             # loads reading it (queued or in flight)


@dataclass
class _PoolIndex:
    free: list[int]
    # Ready, unpinned entries, least recently used first: exactly the evictable ones.
    lru: collections.OrderedDict[TierKey, None] = field(default_factory=collections.OrderedDict)


class HostTierScheduler(TierSchedulerBase):
    def __init__(self, groups: Sequence[KVCacheGroup], block_size: int, size_bytes: int,
                 key_extra: bytes = b"") -> None:
        super().__init__()
        self.block_size = block_size
        self.pools = plan_pools(groups, block_size, size_bytes)
        self._group_pool = {gid: p for p, pool in enumerate(self.pools) for gid in pool.group_ids}
        self._group_keys = {g.group_id: group_key(g, block_size, key_extra)
                            for g in groups if g.spec.persisted}
        # Free slots popped from the end: lowest first, so that a fresh tier fills in order.
        self._index = [_PoolIndex(list(range(pool.num_slots - 1, -1, -1))) for pool in self.pools]
        self._entries: dict[TierKey, _Entry] = {}

    # ----------------------------------------------------------------------------- look-ups
    def get_num_new_matched_tokens(self, request_hashes: Sequence[bytes], group_ids: Sequence[int],
                                   num_device_tokens: int, traffic_class: str | None = None,
                                   next_hash: bytes | None = None) -> int:
        if num_device_tokens % self.block_size:
            raise ValueError(f"num_device_tokens={num_device_tokens} is not whole blocks of {self.block_size}")
        keys = [self._group_keys[g] for g in group_ids if g in self._group_keys]
        if not keys:
            return 0
        n = 0
        for block_hash in request_hashes[num_device_tokens // self.block_size:]:
            if not all(self._loadable((k, block_hash)) for k in keys):
                break
            n += 1
        return n * self.block_size

    def _loadable(self, key: TierKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    # -------------------------------------------------------------------------------- loads
    def allocate_loads(self, request_id: str, block_hashes: Sequence[bytes],
                       device_block_ids: Mapping[int, Sequence[int]],
                       traffic_class: str | None = None, first_block: int = 0) -> list[KVTransfer]:
        self._check_loads_allowed(request_id)
        # Check everything before changing anything: a refusal leaves the tier as it was.
        for group_id, ids in device_block_ids.items():
            if group_id not in self._group_keys:
                raise ValueError(f"layer group {group_id} is not persisted: its KV is rebuilt, never loaded")
            if len(ids) != len(block_hashes):
                raise ValueError(f"group {group_id}: {len(ids)} device blocks for {len(block_hashes)} hashes")
            for block_hash in block_hashes:
                if not self._loadable((self._group_keys[group_id], block_hash)):
                    raise LookupError(f"group {group_id}: a block is not (or no longer) loadable; call "
                                      "allocate_loads right after get_num_new_matched_tokens")
        transfers = []
        for group_id, ids in device_block_ids.items():
            if not ids:
                continue
            keys = [(self._group_keys[group_id], h) for h in block_hashes]
            for key in keys:
                entry = self._entries[key]
                entry.pins += 1
                self._index[entry.pool].lru.pop(key, None)
            transfer = self._new_transfer(True, request_id, group_id, ids, keys)
            self._queued_loads.append(transfer)
            transfers.append(transfer)
        return transfers

    def _new_transfer(self, is_load: bool, request_id: str, group_id: int, device_block_ids: Sequence[int],
                      keys: list[TierKey]) -> KVTransfer:
        return KVTransfer(self._new_transfer_id(is_load, request_id, keys), request_id, group_id,
                          list(device_block_ids), [self._entries[k].slot for k in keys])

    def _unpin(self, keys: Sequence[TierKey]) -> None:
        # Tail first, so that a prefix's last blocks are the first evicted: a later block is
        # worthless without the ones before it.
        for key in reversed(keys):
            entry = self._entries[key]
            entry.pins -= 1
            if entry.pins == 0:
                self._index[entry.pool].lru[key] = None

    def _load_cancelled(self, transfer: _Transfer) -> None:
        self._unpin(transfer.keys)

    # -------------------------------------------------------------------------------- saves
    def save_blocks(self, request_id: str, group_id: int, block_hashes: Sequence[bytes],
                    device_block_ids: Sequence[int], traffic_class: str | None = None,
                    positions: Sequence[int] | None = None) -> list[KVTransfer]:
        if len(block_hashes) != len(device_block_ids):
            raise ValueError(f"{len(device_block_ids)} device blocks for {len(block_hashes)} hashes")
        if group_id not in self._group_keys:
            self._stats.refused_saves += len(block_hashes)   # sliding window: never persisted
            return []
        self._check_saves_allowed(request_id)
        pool = self._group_pool[group_id]
        group = self._group_keys[group_id]
        keys: list[TierKey] = []
        ids: list[int] = []
        for i, (block_hash, block_id) in enumerate(zip(block_hashes, device_block_ids)):
            key = (group, block_hash)
            if key in self._entries:
                continue   # held, or being saved (two requests computed the same block)
            slot = self._take_slot(pool)
            if slot is None:
                # Every slot is pinned or pending; the blocks after this one would be
                # unreachable without it, so none of them is saved either.
                self._stats.dropped_saves += sum((group, h) not in self._entries for h in block_hashes[i:])
                break
            self._entries[key] = _Entry(pool, slot)
            keys.append(key)
            ids.append(block_id)
        if not keys:
            return []
        transfer = self._new_transfer(False, request_id, group_id, ids, keys)
        self._queued_saves.append(transfer)
        return [transfer]

    def _take_slot(self, pool: int) -> int | None:
        index = self._index[pool]
        if index.free:
            return index.free.pop()
        if not index.lru:
            return None
        key, _ = index.lru.popitem(last=False)
        self._stats.evictions += 1
        return self._entries.pop(key).slot

    # ----------------------------------------------------------------------- step boundary
    def on_transfers_finished(self, transfer_ids: Sequence[int],
                              failed_ids: Sequence[int] = ()) -> FinishedTransfers:
        # Host loads never fail (failed_transfers reports none): `failed_ids` stays empty, so it
        # is not passed on.
        return super().on_transfers_finished(transfer_ids)

    def _load_finished(self, transfer: _Transfer, ok: bool) -> None:
        self._unpin(transfer.keys)
        self._stats.loaded_blocks += len(transfer.keys)

    def _save_finished(self, transfer: _Transfer, ok: bool) -> None:
        for key in reversed(transfer.keys):   # tail first, as in _unpin
            entry = self._entries[key]
            entry.ready = True
            if not entry.pins:
                self._index[entry.pool].lru[key] = None
        self._stats.saved_blocks += len(transfer.keys)

    # -------------------------------------------------------------------------------- stats
    def stats(self) -> KVConnectorStats:
        stats = self._stats.copy()
        stats.stored_blocks = len(self._entries)
        stats.stored_bytes = sum((pool.num_slots - len(index.free)) * pool.slot_bytes   # slots taken
                                 for pool, index in zip(self.pools, self._index))
        return stats


# ------------------------------------------------------------------------------- worker side
def _word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer type that tiles `nbytes`: the copies move words, not elements, so any
    storage dtype (fp8 too, which CPU index kernels lack) moves bit for bit, and fewer of them."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def _pages(cache: torch.Tensor, rows_per_block: int, word: torch.dtype) -> torch.Tensor:
    """A [num_blocks * rows_per_block, heads, dim] KV tensor as [num_blocks, page words] (an
    alias). A block holds block_size rows, or fewer of a compressed kind (specs.py)."""
    return cache.view(torch.uint8).view(cache.shape[0] // rows_per_block, -1).view(word)


class HostTierWorker(KVConnectorWorker):
    def __init__(self, size_bytes: int, device: torch.device) -> None:
        self.size_bytes = size_bytes
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._buffers: list[HostBuffer] = []
        self._pool_pages: list[torch.Tensor] = []                  # [slots, layers, 2, words] each
        self._group_pool: dict[int, int] = {}
        self._group_pages: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._deferred_saves: list[KVTransfer] = []
        self._in_flight: collections.deque[tuple[int, torch.cuda.Event]] = collections.deque()
        self._done: list[int] = []                                 # CPU: copied, not reported yet

    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           groups: Sequence[KVCacheGroup], block_size: int) -> None:
        pools = plan_pools(groups, block_size, self.size_bytes)
        by_id = {g.group_id: g for g in groups}
        for p, pool in enumerate(pools):
            word = _word_dtype(pool.page_bytes)
            buffer = HostBuffer(pool.num_slots * pool.slot_bytes, self.device)
            self._buffers.append(buffer)
            self._pool_pages.append(buffer.device_view.view(word).view(pool.num_slots, pool.num_layers, 2, -1))
            for group_id in pool.group_ids:
                self._group_pool[group_id] = p
                group = by_id[group_id]
                rows = group.spec.rows_per_block(block_size)
                self._group_pages[group_id] = [(_pages(k, rows, word), _pages(v, rows, word))
                                               for k, v in group_kv_tensors(kv_caches, groups, group)]
        logger.info("host KV tier: %s, %.2f GiB", ", ".join(
            f"{pool.num_slots} blocks of groups {list(pool.group_ids)}" for pool in pools),
            sum(b.nbytes for b in self._buffers) / 2**30)

    def start_transfers(self, meta: KVConnectorMetadata) -> None:
        self._run(meta.loads, load=True)
        self._deferred_saves.extend(meta.saves)

    def after_forward(self) -> None:
        saves, self._deferred_saves = self._deferred_saves, []
        self._run(saves, load=False)

    def _run(self, transfers: list[KVTransfer], load: bool) -> None:
        if not transfers:
            return
        if not self._cuda:
            for transfer in transfers:
                self._copy(transfer, load)
                self._done.append(transfer.transfer_id)
            return
        # Behind everything queued on the compute stream so far: for saves, the forward that
        # wrote their blocks; for loads, an earlier step that may still write blocks the
        # scheduler has since freed and handed to this load.
        queued = torch.cuda.Event()
        queued.record()
        self._stream.wait_event(queued)
        with torch.cuda.stream(self._stream):
            for transfer in transfers:
                self._copy(transfer, load)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._in_flight.append((transfer.transfer_id, event))

    def _copy(self, transfer: KVTransfer, load: bool) -> None:
        """One transfer: 2 index ops per layer and K/V, whatever the number of blocks."""
        pages = self._pool_pages[self._group_pool[transfer.group_id]]
        blocks = to_device(transfer.device_block_ids, self.device, torch.long)
        slots = to_device(transfer.tier_slots, self.device, torch.long)
        for layer, kv in enumerate(self._group_pages[transfer.group_id]):
            for half, cache in enumerate(kv):
                tier = pages[:, layer, half]
                if load:
                    cache.index_copy_(0, blocks, tier.index_select(0, slots))
                else:
                    tier.index_copy_(0, slots, cache.index_select(0, blocks))

    def finished_transfers(self) -> list[int]:
        done, self._done = self._done, []
        # One stream, so transfers complete in the order they were queued.
        while self._in_flight and self._in_flight[0][1].query():
            done.append(self._in_flight.popleft()[0])
        return done

    def wait_all(self) -> None:
        self.after_forward()
        if self._stream is not None:
            self._stream.synchronize()
