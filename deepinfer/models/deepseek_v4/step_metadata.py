"""What the Triton path of DeepSeek-V4 (paged_kernels.py, step_compressor.py) reads of a step,
built on the host from its layout: per token its chunk, position, floors, ring slot (rings.py)
and its request's segment of rows; per KV group the chunks' block tables. A CUDA graph's
metadata (decode_graphs.py) has the same fields in static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.layers.attention.backends.base import StepLayout
from deepinfer.models.deepseek_v4.paged import V4Metadata, chunk_rows
from deepinfer.models.deepseek_v4.rings import SLOT_KEY, ProjectionRings, ring_rows


@dataclass(kw_only=True)
class V4KernelMetadata(V4Metadata):
    """Per token of the step (row order): its chunk (row of the tables), position and window
    floor, its request's ring slot (rings.py), the position, row and end of its request's tokens
    in the step (seg_start, seg_row, seg_end: a request's rows are consecutive) and its write
    floor; per KV group, the chunks' block tables as one padded [chunks, blocks] int32 tensor.
    What step_compressor.py asks of the step (which rows pool a block, the kernels' new-row
    offsets, the most rows a token reads) comes from the host's copy of the positions; a CUDA
    graph's metadata (decode_graphs.py) answers it without the host."""

    tok_chunk: torch.Tensor
    tok_pos: torch.Tensor
    tok_floor: torch.Tensor
    tok_slot: torch.Tensor
    seg_start: torch.Tensor
    seg_row: torch.Tensor
    seg_end: torch.Tensor
    tok_write_floor: torch.Tensor
    tables: list[torch.Tensor]
    host_pos: np.ndarray | None = None        # positions (None: a graph's metadata)
    chunk_starts: np.ndarray | None = None    # each chunk's first position
    cached: dict = field(default_factory=dict)   # what the step's layers ask, computed once
    # The step positions' rope cos / sin per rotary setting: filled during one forward, emptied by
    # the model at the start of each (a graph's warm-up and its capture must each compute them).
    rope: dict = field(default_factory=dict)

    def window_low(self, window: int) -> torch.Tensor:
        """[T] each token's first window key position."""
        return self._once(("low", window), lambda: torch.maximum(
            torch.clamp_min(self.tok_pos - (window - 1), 0), self.tok_floor).to(torch.int32).contiguous())

    def rope_tables(self, rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary.cos_sin of the step's positions, once a forward."""
        key = id(rotary)
        if key not in self.rope or self.rope[key][0] is not positions:
            self.rope[key] = (positions, rotary.cos_sin(positions))
        return self.rope[key][1]

    def _once(self, key, make):
        if key not in self.cached:
            self.cached[key] = make()
        return self.cached[key]

    def _pooling_host(self, rate: int) -> np.ndarray:
        return self._once(("pool_host", rate), lambda: np.flatnonzero((self.host_pos + 1) % rate == 0))

    def pooling_rows(self, rate: int) -> torch.Tensor:
        """The rows whose token completes a compressed block: p + 1 a multiple of rate."""
        return self._once(("pool", rate), lambda: self.step.to_device(self._pooling_host(rate)))

    def tail_rows(self) -> torch.Tensor:
        """The rows whose token ends a KV block."""
        return self._once("tail", lambda: self.step.to_device(
            np.flatnonzero((self.host_pos + 1) % self.block_size == 0)))

    def new_row_starts(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chunk, the first compressed row it completes (start // rate) and that row's index
        among the step's new rows (triton_attention's first_new and new_off): how many rows
        before the chunk's first pool a block."""
        def make():
            first_rows = [a for _, a, _ in chunk_rows(self.step)]
            both = np.stack([self.chunk_starts // rate, np.searchsorted(self._pooling_host(rate), first_rows)])
            both = self.step.to_device(both.astype(np.int32))
            return both[0], both[1]
        return self._once(("starts", rate), make)

    def rows_bound(self, rate: int) -> int:
        """At least every token's complete compressed rows (the indexer's score width)."""
        return int(self.host_pos.max() + 1) // rate if len(self.host_pos) else 0


# V4KernelMetadata's per-token fields, in the two dtypes they are copied in (one copy each).
INT32_FIELDS = ("tok_chunk", "tok_pos", "tok_floor")
INT64_FIELDS = ("tok_slot", "seg_start", "seg_row", "seg_end", "tok_write_floor")


@dataclass
class TokenLayout:
    pos: np.ndarray
    chunk_starts: np.ndarray
    fields: dict                         # name -> numpy array, INT32_FIELDS and INT64_FIELDS
    new_slots: list                      # (chunk row, slot) of requests whose slot is new, at start > 0

    def to_device(self, step: StepLayout) -> dict[str, torch.Tensor]:
        out = {}
        for names, dtype in ((INT32_FIELDS, np.int32), (INT64_FIELDS, np.int64)):
            packed = step.to_device(np.stack([self.fields[n] for n in names]).astype(dtype))
            out.update(zip(names, packed))
        return out


def token_layout(step: StepLayout, rings: ProjectionRings) -> TokenLayout:
    """Per token of the step: chunk, position, floors, ring slot and its request's segment (a
    request's rows are consecutive: one prefill chunk, or the decode rows of one chunk)."""
    rows = chunk_rows(step)
    n = step.num_tokens
    out = {name: np.zeros(n, dtype=np.int64) for name in ("tok_slot", "seg_start", "seg_row", "seg_end",
                                                          "tok_write_floor")}
    chunk_of = np.zeros(n, dtype=np.int32)
    pos = np.zeros(n, dtype=np.int64)
    floor = np.zeros(n, dtype=np.int32)
    starts = np.zeros(len(rows), dtype=np.int64)
    new_slots = []
    i = 0
    while i < len(rows):
        # A segment: the consecutive chunks of one request (decode rows of a verifying chunk).
        j = i
        while j + 1 < len(rows) and rows[j + 1][0].model_state is rows[i][0].model_state:
            j += 1
        first_chunk, a0, _ = rows[i]
        held = first_chunk.model_state.get(SLOT_KEY)
        slot = rings.slot(first_chunk.model_state, first_chunk.start)
        if (held is None or not held.index) and first_chunk.start > 0 and rings.compressors:
            # Resuming at a block boundary (a prefix hit) leaves no compression block unfinished
            # (the block size is a multiple of every rate); anywhere else the state is lost.
            if first_chunk.start % step.block_size:
                raise RuntimeError(f"DeepSeek-V4: request {first_chunk.request_id} resumes at position "
                                   f"{first_chunk.start}, inside a KV block, without its compressor state")
            new_slots.append((i, slot))
        seg_end = rows[j][0].start + rows[j][0].num_tokens
        slot.end = seg_end
        for k in range(i, j + 1):
            c, a, b = rows[k]
            chunk_of[a:b] = k
            pos[a:b] = np.arange(c.start, c.start + b - a)
            floor[a:b] = c.window_floor
            starts[k] = c.start
            out["tok_write_floor"][a:b] = c.write_floor
        a_end = rows[j][2]
        out["tok_slot"][a0:a_end] = slot.index
        out["seg_start"][a0:a_end] = first_chunk.start
        out["seg_row"][a0:a_end] = a0
        out["seg_end"][a0:a_end] = seg_end
        i = j + 1
    return TokenLayout(pos, starts, dict(out, tok_chunk=chunk_of, tok_pos=pos, tok_floor=floor), new_slots)


def padded_tables(step: StepLayout) -> list[np.ndarray]:
    """Per KV group, the chunks' block tables as one [chunks, widest] int32 array (0-padded)."""
    tables = []
    for per_chunk in step.block_tables:
        width = max([len(t) for t in per_chunk] + [1])
        table = np.zeros((max(len(per_chunk), 1), width), dtype=np.int32)
        for i, t in enumerate(per_chunk):
            table[i, :len(t)] = t
        tables.append(table)
    return tables


def seed_rings(meta: V4KernelMetadata, new_slots: list) -> None:
    """A request whose first chunk starts at a block boundary after a prefix hit has nothing in
    its ring; the overlapping compressors' next row pools the last block's Ca, which the page
    before keeps in its tail rows (paged.py): copy it into the ring, where step_compressor.py
    reads positions before the chunk."""
    if not new_slots:
        return
    rings, bs = meta.rings, meta.block_size
    chunks = [c for c, _, _ in chunk_rows(meta.step)]
    for key, compressor in rings.compressors.items():
        if not compressor.overlap:
            continue
        rate, d = compressor.rate, compressor.dim
        index = rings.kv_index[key]
        cache = meta.kv_caches[meta.layer_to_slot[index]][0]
        per_page = bs // rate
        ring_kv, ring_gate = rings.flat(key)
        for chunk_row, slot in new_slots:
            chunk = chunks[chunk_row]
            block = chunk.block_ids[meta.layer_to_group[index]][chunk.start // bs - 1]
            first = block * (per_page + 2 * rate) + per_page
            saved = cache[first:first + 2 * rate, 0]
            rows = ring_rows(slot.index, torch.arange(chunk.start - rate, chunk.start, device=cache.device),
                             rings.length(key))
            ring_kv[rows, :d] = saved[:rate].to(ring_kv.dtype)
            ring_gate[rows, :d] = saved[rate:].to(ring_gate.dtype)
