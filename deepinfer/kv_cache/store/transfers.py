"""Per-request transfer bookkeeping shared by the tiers' scheduler sides (host.py, persistent.py).

A transfer is queued by allocate_loads or save_blocks, built (handed to the worker in a
KVConnectorMetadata) by the next build_connector_meta, and finished when the worker reports it
(on_transfers_finished). Per request, the ids of its loads and saves still queued or in flight;
a request that finished, or whose loads were aborted, while some are is released (reported in
FinishedTransfers.released) once none are left. What a finished or cancelled transfer means to
the tier's index (pins, readiness, remembered keys, counters) is the subclass's, through hooks.
"""

from __future__ import annotations

import abc
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.kv_cache.connector import FinishedTransfers, KVConnectorScheduler, TierKey
from deepinfer.types.plan import KVConnectorMetadata, KVTransfer
from deepinfer.types.tier_stats import KVConnectorStats, LatencyHistogram


@dataclass
class _Transfer:
    is_load: bool
    request_id: str
    keys: list[TierKey]
    num_blocks: int = 0       # blocks it moves (a persistent store's key names a run of them)
    built: bool = False       # handed to the worker in a KVConnectorMetadata
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class _RequestTransfers:
    loads: set[int] = field(default_factory=set)
    saves: set[int] = field(default_factory=set)
    failed: bool = False             # a load of it failed: report in `failed`, not `loaded`
    release_pending: bool = False    # finished or load-aborted: report in `released` once idle


class TierSchedulerBase(KVConnectorScheduler):
    """The transfer records of a tier's scheduler side; subclasses hold the index and queue the
    transfers (_new_transfer, then append to _queued_loads / _queued_saves)."""

    def __init__(self) -> None:
        self._transfers: dict[int, _Transfer] = {}      # queued or in flight
        self._requests: dict[str, _RequestTransfers] = {}
        self._queued_loads: list[KVTransfer] = []
        self._queued_saves: list[KVTransfer] = []
        self._ids = itertools.count(1)
        self._stats = KVConnectorStats()
        # Queued to reported finished, of transfers that succeeded (kv_cache/tier_stats.py).
        self.load_latency = LatencyHistogram()
        self.save_latency = LatencyHistogram()

    # -------------------------------------------------------------------------------- hooks
    def _load_cancelled(self, transfer: _Transfer) -> None:
        """A load dropped before it was built (the worker never saw it)."""

    @abc.abstractmethod
    def _load_finished(self, transfer: _Transfer, ok: bool) -> None:
        """A built load the worker reported: finished (`ok`) or failed."""

    @abc.abstractmethod
    def _save_finished(self, transfer: _Transfer, ok: bool) -> None:
        """A built save the worker reported: finished (`ok`) or failed."""

    # ---------------------------------------------------------------------------- transfers
    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._stats.queries += num_tokens
        self._stats.hits += num_hit_tokens

    def _check_loads_allowed(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and state.release_pending:
            raise ValueError(f"request {request_id!r} still has aborted loads in flight; wait for its release")

    def _check_saves_allowed(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and state.release_pending:
            raise ValueError(f"request {request_id!r} has finished: its blocks may be freed, so not saved")

    def _new_transfer_id(self, is_load: bool, request_id: str, keys: list[TierKey],
                         num_blocks: int | None = None) -> int:
        """Record a transfer of `keys` (`num_blocks` blocks; default one a key) for `request_id`;
        the caller builds its KVTransfer."""
        transfer_id = next(self._ids)
        self._transfers[transfer_id] = _Transfer(is_load, request_id, keys,
                                                 len(keys) if num_blocks is None else num_blocks)
        state = self._requests.setdefault(request_id, _RequestTransfers())
        (state.loads if is_load else state.saves).add(transfer_id)
        return transfer_id

    def _cancel_unbuilt_loads(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        cancelled = {t for t in state.loads if not self._transfers[t].built}
        if not cancelled:
            return
        for transfer_id in cancelled:
            self._load_cancelled(self._transfers.pop(transfer_id))
        state.loads -= cancelled
        self._queued_loads = [t for t in self._queued_loads if t.transfer_id not in cancelled]

    def abort_loads(self, request_id: str) -> bool:
        self._cancel_unbuilt_loads(request_id)
        state = self._requests.get(request_id)
        if state is None or not state.loads:
            self._forget_if_idle(request_id)
            return False
        state.release_pending = True
        return True

    # ----------------------------------------------------------------------- step boundary
    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(self._queued_loads, self._queued_saves)
        for transfer in itertools.chain(meta.loads, meta.saves):
            self._transfers[transfer.transfer_id].built = True
        self._queued_loads, self._queued_saves = [], []
        return meta

    def on_transfers_finished(self, transfer_ids: Sequence[int],
                              failed_ids: Sequence[int] = ()) -> FinishedTransfers:
        loads_done: dict[str, None] = {}   # insertion-ordered set of requests touched
        touched: dict[str, None] = {}
        failed = set(failed_ids)
        for transfer_id in itertools.chain(transfer_ids, failed_ids):
            transfer = self._transfers.pop(transfer_id, None)
            if transfer is None:
                continue
            state = self._requests[transfer.request_id]
            ok = transfer_id not in failed
            if ok:
                (self.load_latency if transfer.is_load else self.save_latency).observe(
                    time.monotonic() - transfer.queued_at)
            if transfer.is_load:
                state.loads.discard(transfer_id)
                if not ok:
                    state.failed = True
                self._load_finished(transfer, ok)
                loads_done[transfer.request_id] = None
            else:
                self._save_finished(transfer, ok)
                state.saves.discard(transfer_id)
            touched[transfer.request_id] = None
        done = FinishedTransfers([], [])
        for request_id in touched:
            state = self._requests[request_id]
            if request_id in loads_done and not state.loads and not state.release_pending:
                (done.failed if state.failed else done.loaded).append(request_id)
                state.failed = False
            if state.release_pending and not state.loads and not state.saves:
                done.released.append(request_id)
            self._forget_if_idle(request_id)
        return done

    def request_finished(self, request_id: str) -> bool:
        self._cancel_unbuilt_loads(request_id)
        state = self._requests.get(request_id)
        if state is None or not (state.loads or state.saves):
            self._forget_if_idle(request_id)
            return False
        state.release_pending = True
        return True

    def _forget_if_idle(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state.loads and not state.saves:
            del self._requests[request_id]

    # -------------------------------------------------------------------------------- stats
    @property
    def num_pending_transfers(self) -> int:
        return len(self._transfers)
