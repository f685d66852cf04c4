"""Layer-wise copies of a persistent store's loads into the device blocks (kv_store_layerwise_load):
what lets the step that computes a request's remaining prompt start before its loaded prefix is
in the device blocks, as vLLM's KV connector (wait_for_layer_load) and LMCache's layer-wise mode
do.

A load is handed over (StoreLoads._finish_loads) once every run of it has been read AND checked:
the runs that landed earlier were copied in whole as they landed (a long prefix streams through
the staging buffer); the ones still in staging are copied here, layer by layer, and the load is
reported finished at once. The forward that follows waits, before each attention layer, only for
that layer's copies (wait_layer, called through the attention layer's gate, worker/kv_layer_gate.py);
after the forward, for all of them (wait_all), so that nothing else that reads or writes device
blocks (drafters, saves, a CUDA graph, the next step, another load into a reused block) can
overtake a copy.

Why the checks come first (and no step's result is ever discarded): a run's bytes reach this
stage only once its checksum passed; a bad run fails the whole load before it is handed over,
and the request recomputes as on the plain path. Discarding a step computed over bad KV instead
would have to chase what that step published: its tokens, its blocks in the device prefix cache,
and its saves, which would write KV computed over garbage into a store other instances read.

  CUDA: the copies are queued on the tier's side stream when the load is handed over (behind the
        device work queued so far: a block may be reused from an earlier step), an event recorded
        after each layer's; wait_layer makes the compute stream wait for that layer's event, so
        the forward's first layers run while the later layers' copies are still in flight.
  CPU:  copies are synchronous, so they are deferred instead: wait_layer(L) performs layer L's
        copies right before layer L's attention reads them, and wait_all performs what is left.
        That keeps the ordering logic the same as on CUDA and exercised by the CPU tests (a
        forward that skipped a layer's wait would read a block that is not there yet). Pending
        copies are applied in the order they were handed over, and before any other copy into
        device blocks (StoreLoads._copy_in) or out of them (a save's gather), so a block loaded
        twice ends with the later load's bytes, as on the plain path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.kv_cache.store.staging import StagingBuffer
from deepinfer.platforms.transfer import to_device


@dataclass
class _Pending:
    """One load's runs still in staging: copied into its device blocks layer by layer."""

    group_id: int
    block_ids: list[int]                  # device blocks, one per slot
    slots: list[int]                      # staging slots, freed once every layer is copied
    done_layers: set[int] = field(default_factory=set)      # CPU: layers copied so far
    events: list[torch.cuda.Event] = field(default_factory=list)   # CUDA: one per layer of the group


class LayerwiseCopies:
    """The copies handed over and not yet known complete, and the per-layer waits on them.

    `rows(group_id, device_side)` gives the staging buffer as [slots, layers, tensors, words]
    (StoreTierWorker._rows); `pages[group_id]` the device pages of the group's layers, in the
    order of its layer_ids; `free(slots)` returns staging slots to the loads' half."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None,
                 rows: Callable[[int, bool], torch.Tensor], free: Callable[[list[int]], None]) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = stream
        self._rows = rows
        self._free = free
        self._pages: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        self._layer_of: dict[int, tuple[int, int]] = {}   # model layer id -> (group id, index in the group)
        self._pending: list[_Pending] = []
        # Layers whose copies a forward's gate performed (CPU) or waited for (CUDA): what the
        # tests check to know the per-layer path ran, not the fence after the forward.
        self.layers_waited = 0

    def register(self, pages: dict[int, list[tuple[torch.Tensor, ...]]],
                 layer_ids: dict[int, Sequence[int]]) -> None:
        """The device pages of each persisted group and the model layer ids they belong to."""
        self._pages = pages
        self._layer_of = {layer: (group_id, j) for group_id, ids in layer_ids.items() for j, layer in enumerate(ids)}

    def __bool__(self) -> bool:
        return bool(self._pending)

    # ------------------------------------------------------------------------------ hand-over
    def add(self, group_id: int, block_ids: list[int], slots: list[int]) -> None:
        """Runs read and checked, in staging `slots`, for the device blocks `block_ids`."""
        if not block_ids:
            self._free(slots)
            return
        pending = _Pending(group_id, block_ids, slots)
        if self._cuda:
            self._queue_cuda(pending)
        self._pending.append(pending)

    def _queue_cuda(self, pending: _Pending) -> None:
        pages = self._pages[pending.group_id]
        queued = torch.cuda.Event()
        queued.record()
        self._stream.wait_event(queued)
        with torch.cuda.stream(self._stream):
            blocks = to_device(pending.block_ids, self.device, torch.long)
            # One copy of the runs' slots (all layers) into device memory first: torch has no
            # asynchronous strided host-to-device copy, and a copy per block and layer would cost
            # the step thread more than it saves. The per-layer part is the scatter into the pages.
            src = self._to_device(pending.group_id, pending.slots)
            for j, tensors in enumerate(pages):
                for t, page in enumerate(tensors):
                    page.index_copy_(0, blocks, src[:, j, t])
                event = torch.cuda.Event()
                event.record(self._stream)
                pending.events.append(event)

    def _to_device(self, group_id: int, slots: list[int]) -> torch.Tensor:
        """The slots' rows [slots, layers, tensors, words] on the device (inside the side stream)."""
        host = self._rows(group_id, False)
        if host.is_pinned():
            src = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=self.device)
            for i, first, n in StagingBuffer.runs(slots):
                src[i:i + n].copy_(host[first:first + n], non_blocking=True)
            return src
        return self._rows(group_id, True).index_select(0, to_device(slots, self.device, torch.long))

    # ---------------------------------------------------------------------------------- waits
    def wait_layer(self, layer_id: int) -> None:
        """Before attention layer `layer_id` reads or writes its pages: its copies are done
        (CPU) or the compute stream waits for them (CUDA). Layers of groups not persisted, and
        layers with nothing pending, return at once."""
        where = self._layer_of.get(layer_id)
        if where is None or not self._pending:
            return
        group_id, j = where
        waited = False
        for pending in self._pending:
            if pending.group_id != group_id:
                continue
            waited = True
            if self._cuda:
                torch.cuda.current_stream().wait_event(pending.events[j])
            elif j not in pending.done_layers:
                self._copy_layer(pending, j)
        self.layers_waited += waited
        if not self._cuda:
            self._drop_complete()

    def wait_all(self) -> None:
        """Every pending copy is done (CPU) or ordered before what the compute stream runs next
        (CUDA: the stream waits for each load's last layer; the host never does). CUDA copies
        stay listed until poll sees them complete; waiting on them again costs nothing."""
        for pending in self._pending:
            if self._cuda:
                torch.cuda.current_stream().wait_event(pending.events[-1])
            else:
                for j in range(len(self._pages[pending.group_id])):
                    if j not in pending.done_layers:
                        self._copy_layer(pending, j)
        self._drop_complete()

    def poll(self) -> None:
        """CUDA: forget the copies that completed and free their slots (no wait)."""
        if self._cuda:
            self._drop_complete()

    def _copy_layer(self, pending: _Pending, j: int) -> None:
        rows = self._rows(pending.group_id, False)
        slots = torch.tensor(pending.slots, dtype=torch.long)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        for t, page in enumerate(self._pages[pending.group_id][j]):
            page.index_copy_(0, blocks, rows[slots, j, t])
        pending.done_layers.add(j)

    def _drop_complete(self) -> None:
        """Free the slots of the copies that are done (CUDA: whose last event completed)."""
        keep = []
        for pending in self._pending:
            complete = (pending.events[-1].query() if self._cuda
                        else len(pending.done_layers) == len(self._pages[pending.group_id]))
            if complete:
                self._free(pending.slots)
            else:
                keep.append(pending)
        self._pending = keep
