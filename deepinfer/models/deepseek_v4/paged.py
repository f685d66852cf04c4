"""DeepSeek-V4 on the engine's paged KV cache, the reference path: for each request chunk of a
step, the layer's state is gathered from the pages, the reference attention (attention.py,
compressor.py, indexer.py) runs on it, and what it produced is written back.

Each main layer has up to three KV kinds (kv_cache/specs.py), each its own group and pool:
  window      SlidingWindowSpec: one K=V row per token (shared_kv), freed behind the window
  compressed  CompressedSpec(rate): CSA and HCA rows, one per `rate` tokens, kept like full KV
  index keys  CompressedSpec(rate): the Lightning Indexer's keys of CSA layers
A compressed page of block b holds the rows of tokens [b*bs, (b+1)*bs), bs / rate of them, and
for the overlapping compressors (CSA's and its indexer's) a tail of 2 * rate rows: the first
halves ("Ca") of the kv and the gate projections (before position_bias) of the block's last
`rate` tokens, which the next block's first row pools. A prefix hit ends on a block boundary,
where no compression block is unfinished (bs is a multiple of every rate), so the tail is all a
resumed request needs: its next step rebuilds exactly the state a request that never stopped has.

Between steps a request also keeps each compressor's projections of its latest tokens: the
unfinished block's and, when overlapping, the block's before, in its slot of the compressors'
rings on the device (rings.py; the slot is in RunnerRequestState.model_state). Kept by position,
they stay right when a step's last tokens are dropped (rejected drafts): a chunk reads only
positions below its own start.

SWA Bounded Replay (StepChunk.window_floor / write_floor) applies to the window: it gathers no
row below the floor. The replayed chunk's compressed rows are recomputed for its own queries,
but pages below write_floor ("keep") are not overwritten: later steps read the exact rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.layers.attention.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupMetadata,
    StepLayout,
)
from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.rings import ProjectionRings, RequestSlot
from deepinfer.models.deepseek_v4.state import CompressorState, LayerState
from deepinfer.worker.request_states import StepChunk


@dataclass(frozen=True)
class LayerKV:
    """A main layer's KV tensors, as indices into the engine's per-layer KV list (kv_cache_specs)."""

    window: int
    compressed: int | None = None
    index: int | None = None


@dataclass(kw_only=True)
class V4Metadata(AttentionMetadata):
    """The step's metadata with the compressors' rings, where each request's recent projections
    live between steps (rings.py)."""

    rings: ProjectionRings


class V4StepBackend(AttentionBackend):
    """Builds the steps' metadata for the V4 model, which addresses its KV pages itself (its
    attention is not the engine's paged attention): the step layout and the write rows."""

    name = "deepseek_v4_reference"
    # Whether the model's forward takes the Triton path (paged_kernels.py) on this backend's steps.
    kernels = False

    def __init__(self, device: torch.device | None = None, kv_cache_dtype: torch.dtype | None = None,
                 rings: ProjectionRings | None = None) -> None:
        super().__init__(device, kv_cache_dtype)
        self.rings = rings

    def build_metadata(self, step: StepLayout) -> AttentionMetadata:
        groups = [GroupMetadata(slot_mapping=m) for m in step.slot_mappings]
        for chunk in step.ordered:   # each request's ring slot, and the end of what this step runs
            self.rings.slot(chunk.model_state, chunk.start).end = chunk.start + chunk.num_tokens
        return V4Metadata(groups=groups, rings=self.rings, **step.metadata_fields(self))

    def write_kv(self, *args, **kwargs):
        raise NotImplementedError("the DeepSeek-V4 model writes its KV itself (paged.py)")

    def attend(self, *args, **kwargs):
        raise NotImplementedError("the DeepSeek-V4 model attends itself (paged.py)")


def chunk_rows(step: StepLayout) -> list[tuple[StepChunk, int, int]]:
    """Each chunk of the step with its token rows [a, b), in row order (decodes first)."""
    rows = [(c, i, i + 1) for i, c in enumerate(step.decodes)]
    rows += [(c, a, b) for c, (a, b) in zip(step.prefills, step.prefill_query_ranges)]
    return rows


def attend_paged(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv: LayerKV, layer: int) -> torch.Tensor:
    """One layer's attention over every chunk of the step: x [tokens, hidden] -> [tokens, hidden].
    The output projection runs once over all chunks (under tensor parallelism: one all-reduce)."""
    out = x.new_empty(x.shape[0], attn.o_b_proj.in_features)
    for chunk, a, b in chunk_rows(meta.step):
        pages = _ChunkPages(meta, chunk)
        state = LayerState(window=pages.window(kv.window, attn.window))
        if attn.compressor is not None:
            state.compressor = pages.compressor_state(kv.compressed, attn.compressor, (layer, "compressor"))
            if kv.index is not None:
                state.indexer = pages.compressor_state(kv.index, attn.compressor.indexer, (layer, "indexer"))
        out[a:b] = attn.low_rank_out(x[None, a:b], positions[a:b], state)[0]
        pages.write_rows(kv.window, state.call_rows[0])
        if attn.compressor is not None:
            pages.write_compressor(kv.compressed, attn.compressor, state.compressor, (layer, "compressor"))
            if kv.index is not None:
                pages.write_compressor(kv.index, attn.compressor.indexer, state.indexer, (layer, "indexer"))
    return attn.o_b_proj(out)


class _ChunkPages:
    """One chunk's view of the pages: the chunk covers positions [start, end) of its request."""

    def __init__(self, meta: V4Metadata, chunk: StepChunk) -> None:
        self.meta, self.chunk = meta, chunk
        self.start, self.end = chunk.start, chunk.start + chunk.num_tokens
        self.bs = meta.block_size
        self.rings = meta.rings
        self.slot: RequestSlot = meta.rings.slot(chunk.model_state, chunk.start)
        self._tables: dict[int, np.ndarray] = {}   # a group's block table as numpy, built once per chunk

    def _cache(self, index: int) -> torch.Tensor:
        return self.meta.kv_caches[self.meta.layer_to_slot[index]][0]    # K = V: one tensor

    def _table(self, index: int) -> np.ndarray:
        group = self.meta.layer_to_group[index]
        if group not in self._tables:
            self._tables[group] = np.asarray(self.chunk.block_ids[group], dtype=np.int64)
        return self._tables[group]

    def _token_rows(self, index: int, positions: np.ndarray) -> torch.Tensor:
        table = self._table(index)
        rows = table[positions // self.bs] * self.bs + positions % self.bs
        return torch.from_numpy(rows).to(self._cache(index).device)

    def _compressed_rows(self, index: int, rate: int, tail: int, rows: np.ndarray) -> torch.Tensor:
        per_page = self.bs // rate
        table = self._table(index)
        flat = table[rows // per_page] * (per_page + tail) + rows % per_page
        return torch.from_numpy(flat).to(self._cache(index).device)

    def _tail_rows(self, index: int, rate: int, tail: int, block: int) -> torch.Tensor:
        per_page = self.bs // rate
        first = int(self._table(index)[block]) * (per_page + tail) + per_page
        return torch.arange(first, first + tail, device=self._cache(index).device)

    # ------------------------------------------------------------------------------- reads
    def window(self, index: int, window: int) -> torch.Tensor | None:
        """The window's rows before the chunk: positions max(start - window + 1, floor) .. start - 1."""
        low = max(self.start - window + 1, self.chunk.window_floor, 0)
        if low >= self.start:
            return None
        return self._cache(index)[self._token_rows(index, np.arange(low, self.start)), 0][None]

    def compressor_state(self, index: int, compressor: Compressor, key, gather_rows: bool = True) -> CompressorState:
        """The compressor's state at the chunk's start: the rows so far from the pages (unless
        not `gather_rows`: the kernels read them there), the unfinished block's projections and
        (overlapping) the last block's Ca from the request's recent projections, or at a block
        boundary from the tail of the block before."""
        rate, d = compressor.rate, compressor.dim
        tail = 2 * rate if compressor.overlap else 0
        done = self.start // rate                     # complete rows before the chunk
        state = CompressorState()
        if not gather_rows:
            state.skipped_rows = done
        elif done:
            rows = self._compressed_rows(index, rate, tail, np.arange(done))
            state.rows = self._cache(index)[rows, 0][None]
        pending_from = done * rate
        needed_from = pending_from - rate if compressor.overlap and done else pending_from
        if self.slot.first <= needed_from < self.start:   # the ring holds them (rings.py)
            kv, gate = self.rings.read(key, self.slot, needed_from, self.start)
            if pending_from < self.start:
                state.pending_kv = kv[pending_from - needed_from:][None]
                state.pending_gate = gate[pending_from - needed_from:][None]
            if needed_from < pending_from:
                state.prev_kv = kv[:rate, :d][None]
                state.prev_gate = (gate[:rate, :d] + compressor.position_bias[:, :d])[None]
        elif needed_from < self.start:
            if self.start % self.bs:
                raise RuntimeError(f"DeepSeek-V4: request {self.chunk.request_id} resumes at position "
                                   f"{self.start}, inside a KV block, without its compressor state")
            # A block boundary (nothing pending): the previous block's tail holds Ca.
            saved = self._cache(index)[self._tail_rows(index, rate, tail, self.start // self.bs - 1), 0]
            state.prev_kv = saved[:rate][None]
            state.prev_gate = (saved[rate:] + compressor.position_bias[:, :d])[None]
        return state

    # ------------------------------------------------------------------------------ writes
    def write_rows(self, index: int, rows: torch.Tensor) -> None:
        """The chunk's own K=V rows of a window group, every position (other requests may hit
        on these blocks at any length, and read whichever rows their window needs)."""
        self._cache(index)[self._token_rows(index, np.arange(self.start, self.end)), 0] = rows.to(
            self._cache(index).dtype)

    def write_compressor(self, index: int, compressor: Compressor, state: CompressorState, key) -> None:
        """The rows the chunk completed, the tails of the blocks it completed, and the recent
        projections the next chunk starts from."""
        rate, d = compressor.rate, compressor.dim
        tail = 2 * rate if compressor.overlap else 0
        cache = self._cache(index)
        first, last = self.start // rate, self.end // rate
        kept = -(-self.chunk.write_floor // rate)     # rows below it stay as cached (replay, keep)
        if last > max(first, kept):
            new = np.arange(max(first, kept), last)
            held = state.rows[0, new - state.skipped_rows]
            cache[self._compressed_rows(index, rate, tail, new), 0] = held.to(cache.dtype)

        # Projections of positions [known_from, end): the ring's before the chunk, then its own.
        known_from = max(self.slot.first, self.start - rate)
        kv, gate = state.call_kv[0], state.call_gate[0]
        if known_from < self.start:
            before_kv, before_gate = self.rings.read(key, self.slot, known_from, self.start)
            kv, gate = torch.cat([before_kv, kv]), torch.cat([before_gate, gate])
        else:
            known_from = self.start
        if tail:
            for boundary in range((self.start // self.bs + 1) * self.bs, self.end + 1, self.bs):
                if boundary <= self.chunk.write_floor or boundary - rate < known_from:
                    continue
                ca = slice(boundary - rate - known_from, boundary - known_from)
                saved = torch.cat([kv[ca, :d], gate[ca, :d]]).to(cache.dtype)
                cache[self._tail_rows(index, rate, tail, boundary // self.bs - 1), 0] = saved
        self.rings.write(key, self.slot, self.start, state.call_kv[0], state.call_gate[0])
