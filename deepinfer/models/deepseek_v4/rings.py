"""Each request's latest compressor projections, on the device: what a V4 compressor carries from
one step to the next, held for every request in one pair of tensors per compressor, so that a
step updates it from the step's own inputs (no per-request work on the host) and a CUDA graph of
decode steps can replay the update.

Per compressor (a main layer's CSA or HCA compressor, or a CSA layer's indexer; keyed by
(layer, "compressor" | "indexer")) two tensors kv, gate [slots, length, width]: slot s holds its
request's projections (kv_proj and gate_proj outputs, gate without position_bias) of position p
in row p % length. A chunk reads the positions of the unfinished block before it (< rate) and,
when blocks overlap, the block before that (rate more): `span` = 2 * rate or rate positions. A
step may also write positions it later drops (rejected drafts, rolled back), and writes up to
`slack` positions of one request; so length = span + slack, and a row is overwritten only once
no chunk reads it any more.

With MTP layers (mtp_drafter.py) two more rings per slot keep, for the latest sliding_window +
slack positions, the main model's last streams (what the MTP layer reads) and the MTP layer's own
K=V rows (its window, mtp_ring.py).

A request takes a slot on its first chunk (`slot`, which records that chunk's start: the ring
holds nothing below it) and gives it back when the runner drops its state (RequestSlot.release,
called through request_states.release_model_state). Slot 0 is never given out: the padding rows of a CUDA
graph and the tokens whose projections need not be kept write there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLOT_KEY = "projection_ring_slot"   # the request's RequestSlot in its model_state


def ring_rows(slots, positions: torch.Tensor, length: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Flat row numbers of `positions` in the `slots` (an index or a tensor broadcasting with
    them) of a ring `length` rows a slot; with `keep`, the positions not kept go to the padding
    slot 0 (a write whose row no one reads)."""
    if keep is not None:
        slots = torch.where(keep, slots, 0)
    return slots * length + positions % length


@dataclass
class RequestSlot:
    index: int
    first: int              # the first position whose projections the slot holds
    rings: ProjectionRings
    end: int = 0            # the end of the latest chunk run (its backend's metadata sets it)

    def release(self) -> None:
        """Give the slot back (the runner dropped the request's state)."""
        if self.index:
            self.rings.free.append(self.index)
            self.index = 0


class ProjectionRings:
    def __init__(self, compressors: dict, kv_index: dict | None = None, slack: int = 17,
                 streams_window: int = 0, stream_shape: tuple[int, ...] = (), mtp_row_width: int = 0) -> None:
        """compressors: key -> Compressor (dim, rate, overlap, kv_proj); kv_index: key -> the index
        of its KV kind in the model's kv_cache_specs (its pages); streams_window: positions of
        main streams (stream_shape each) the MTP drafter reads, and of its layer's K=V rows
        (mtp_row_width each), 0 without MTP layers. Nothing is
        allocated until `allocate` (the runner's reserve_request_state, before it sizes the KV
        pool)."""
        self.compressors = compressors
        self.kv_index = kv_index or {}
        self.slack = slack
        self.streams_window, self.stream_shape = streams_window, stream_shape
        self.streams: torch.Tensor | None = None
        # The MTP layer's own K=V rows of the same positions (mtp_ring.py), mtp_row_width wide.
        self.mtp_row_width = mtp_row_width
        self.mtp_rows: torch.Tensor | None = None
        self.kv: dict = {}
        self.gate: dict = {}
        self.free: list[int] = []
        self.num_slots = 0

    def span(self, key) -> int:
        c = self.compressors[key]
        return 2 * c.rate if c.overlap else c.rate

    def length(self, key) -> int:
        return self.span(key) + self.slack

    def allocate(self, max_requests: int, rows_per_request: int, device: torch.device, dtype: torch.dtype) -> None:
        """Rings for max_requests requests (and the padding slot) that each write up to
        rows_per_request positions a step."""
        self.slack = max(self.slack, rows_per_request)
        self.num_slots = max_requests + 1
        for key, c in self.compressors.items():
            width = c.kv_proj.out_features
            shape = (self.num_slots, self.length(key), width)
            self.kv[key] = torch.zeros(shape, dtype=dtype, device=device)
            self.gate[key] = torch.zeros(shape, dtype=dtype, device=device)
        if self.streams_window:
            self.streams = torch.zeros(self.num_slots, self.streams_length, *self.stream_shape, dtype=dtype,
                                       device=device)
            self.mtp_rows = torch.zeros(self.num_slots, self.streams_length, self.mtp_row_width, dtype=dtype,
                                        device=device)
        self.free = list(range(self.num_slots - 1, 0, -1))

    @property
    def streams_length(self) -> int:
        return self.streams_window + self.slack

    def slot(self, model_state: dict, start: int) -> RequestSlot:
        """The request's slot, taken on its first chunk (which starts at `start`)."""
        held = model_state.get(SLOT_KEY)
        if held is not None and held.index:
            return held
        if not self.num_slots:
            raise RuntimeError("DeepSeek-V4: the compressor rings were never allocated (reserve_request_state)")
        if not self.free:
            raise RuntimeError(f"DeepSeek-V4: every one of the {self.num_slots - 1} compressor ring slots is taken "
                               "(more requests in flight than max_num_seqs)")
        held = RequestSlot(self.free.pop(), start, self)
        model_state[SLOT_KEY] = held
        return held

    def flat(self, key) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self.kv[key], self.gate[key]
        return kv.view(-1, kv.shape[-1]), gate.view(-1, gate.shape[-1])

    def read(self, key, slot: RequestSlot, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections of positions [low, high) of a request: (kv, gate) [high - low, width]."""
        kv, gate = self.flat(key)
        rows = ring_rows(slot.index, torch.arange(low, high, device=kv.device), self.length(key))
        return kv[rows], gate[rows]

    def write(self, key, slot: RequestSlot, start: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Keep the projections of positions [start, start + n) (their last `length` only)."""
        length = self.length(key)
        cut = max(kv.shape[0] - length, 0)
        flat_kv, flat_gate = self.flat(key)
        rows = ring_rows(slot.index, torch.arange(start + cut, start + kv.shape[0], device=flat_kv.device), length)
        flat_kv[rows] = kv[cut:].to(flat_kv.dtype)
        flat_gate[rows] = gate[cut:].to(flat_gate.dtype)

    def write_streams(self, slots: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                      streams: torch.Tensor) -> None:
        """The main streams [T, ...] of tokens at `positions` [T] of requests in `slots` [T]; the
        tokens not `keep` (not among their request's last streams_length) go to the padding slot."""
        rows = ring_rows(slots, positions, self.streams_length, keep)
        self.streams.view(-1, *self.stream_shape)[rows] = streams.to(self.streams.dtype)

    def streams_at(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The main streams of `positions` [N] of the requests in `slots` [N]: [N, ...]."""
        return self.streams.view(-1, *self.stream_shape)[ring_rows(slots, positions, self.streams_length)]
