"""Turns a scheduler plan into the tensors of one forward: token ids, positions, KV addresses.

Rows are ordered decode-first: chunks of exactly one token (a request generating) are batched
into one attention call per layer; longer chunks (prefill, or prefill on top of cached blocks)
follow. A chunk verifying speculative drafts has its drafts (`spec_token_ids`, not yet known to
the runner) as its last tokens, and takes the prefill path: its queries share one gather of the
request's KV (as decode rows, each query would gather its own copy, which costs several times
more at batch 64 on the CPU). Only where a CUDA graph of decode steps replays the step
(`rows_as_decodes`) is it laid out as one decode row per query instead, each row attending up
to its own position: the graph's decode kernel then serves verification too (and a short
continuation chunk, such as a draft model's catch-up on the tokens the target accepted). This
file lays the step out (ids, positions, each token's KV write row) the same way for every
backend; the step's attention backend then builds its own metadata from that layout
(layers/attention/backends/: gathered rows for the reference and CPU backends, block tables for
the Triton kernels). Index arithmetic is done in numpy on the host.

SWA Bounded Replay (StepChunk.window_floor / write_floor): a one-token chunk whose sliding
window still reaches below its request's window floor is laid out as a prefill row, so only the
prefill paths apply the floor and the decode kernels and CUDA graphs never see one. Full-attention
groups write the K/V of positions below the write floor into the null block: their cached rows
stay as they are (other requests may share them), and the chunk's queries read those.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.layers.attention.backends import AttentionBackend, AttentionMetadata, StepLayout, backend_named
from deepinfer.layers.attention.backends.base import flat_rows, sliding_window_of
from deepinfer.platforms.transfer import to_device
from deepinfer.worker.request_states import StepChunk

# The longest continuation chunk (no drafts) laid out as decode rows where a CUDA graph replays
# the step: a draft model's catch-up on the tokens the target accepted is at most 1 + k (k up to
# 16 here; a longer catch-up runs eagerly).
MAX_CONTINUATION_ROWS = 17


@dataclass
class StepInputs:
    chunks: list[StepChunk]        # in row order (decodes first)
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # For each chunk, the index of its last token in the flat token axis.
    last_token_index: list[int]
    # Each row's LoRA adapter slot (lora/manager.py: the runner sets it once the inputs are built),
    # or None: no row has an adapter.
    lora_slots: torch.Tensor | None = None


def max_sliding_window(groups: list[KVCacheGroup]) -> int:
    """The largest sliding window of the model's groups, 0 without any: the widest window a
    query has decides whether its request's window floor still cuts it (is_decode_row)."""
    return max((sliding_window_of(g) or 0 for g in groups), default=0)


def _floor_cuts(chunk: StepChunk, window: int) -> bool:
    """Whether the request's window floor still cuts the window of the chunk's first query (only
    the prefill paths apply a floor); later queries only move further from it."""
    return bool(chunk.window_floor and window and chunk.start - window + 1 < chunk.window_floor)


def is_decode_row(chunk: StepChunk, window: int) -> bool:
    """Whether a chunk takes the decode path: one token, no prompt logprobs, and no window floor
    above its query's window (`window`: max_sliding_window), which only the prefill paths apply.
    A replayed request's decodes become plain decodes once the window has moved past the floor."""
    return chunk.num_tokens == 1 and not chunk.prompt_logprobs and not _floor_cuts(chunk, window)


def fits_decode_rows(chunk: StepChunk, window: int) -> bool:
    """Whether a chunk of several tokens can be laid out as one decode row per token
    (build_step_inputs' `rows_as_decodes`): row j attends to the request's KV up to its own
    position, which the same step's KV write of rows 0..j has put in the cache before attention
    reads it. Two kinds qualify: a chunk verifying drafts (1 + m rows), and a short continuation
    of a request whose earlier tokens are cached (at most MAX_CONTINUATION_ROWS tokens: a draft
    model catching up on the tokens the target accepted, or a prompt's tail after a prefix hit).
    Its first row must itself be a decode row (no live window floor, no prompt logprobs)."""
    if chunk.prompt_logprobs or _floor_cuts(chunk, window):
        return False
    if chunk.spec_token_ids:
        return chunk.num_tokens == 1 + len(chunk.spec_token_ids)
    return chunk.start > 0 and 1 < chunk.num_tokens <= MAX_CONTINUATION_ROWS


def num_decode_rows(chunks: list[StepChunk], window: int) -> int | None:
    """Rows of a step laid out with `rows_as_decodes` (fits_decode_rows), or None when a chunk
    of it needs the prefill path (then no CUDA graph can replay the step)."""
    rows = 0
    for c in chunks:
        if is_decode_row(c, window):
            rows += 1
        elif fits_decode_rows(c, window):
            rows += c.num_tokens
        else:
            return None
    return rows


def _decode_rows(chunk: StepChunk) -> list[StepChunk]:
    """A chunk as one single-token row per query (fits_decode_rows)."""
    return [StepChunk(chunk.request_id, chunk.start + j, 1, chunk.block_ids, False, False, [],
                      chunk.window_floor, chunk.write_floor, chunk.model_state)
            for j in range(chunk.num_tokens)]


def _slots(chunks: list[StepChunk], tables: list[list[int]], block_size: int, full: bool) -> np.ndarray:
    """The cache row of every token of the chunks, in order (tables: each chunk's block ids). A
    one-token chunk (a decode) is looked up directly: numpy per chunk costs more than the lookup,
    at 512 decodes a step. In a full-attention group (`full`), positions below the chunk's write
    floor write into the null block (row position % block_size of block 0), keeping the cached row."""
    parts: list[np.ndarray] = []
    singles: list[int] = []
    for c, ids in zip(chunks, tables):
        if c.num_tokens == 1:
            if c.start < c.write_floor and full:
                singles.append(c.start % block_size)
            else:
                singles.append(ids[c.start // block_size] * block_size + c.start % block_size)
            continue
        if singles:
            parts.append(np.array(singles, dtype=np.int64))
            singles = []
        positions = np.arange(c.start, c.start + c.num_tokens)
        if c.write_floor > c.start and full:
            kept = min(c.write_floor - c.start, c.num_tokens)
            rows = np.empty(c.num_tokens, dtype=np.int64)
            rows[:kept] = positions[:kept] % block_size
            if kept < c.num_tokens:
                rows[kept:] = flat_rows(np.asarray(ids, dtype=np.int64), positions[kept:], block_size)
            parts.append(rows)
            continue
        parts.append(flat_rows(np.asarray(ids, dtype=np.int64), positions, block_size))
    if singles:
        parts.append(np.array(singles, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_step_inputs(chunks: list[StepChunk], token_ids: dict[str, list[int]],
                      groups: list[KVCacheGroup], block_size: int, layer_to_group: list[int],
                      layer_to_slot: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device, backend: AttentionBackend | str, decode_splits: int = 1,
                      fresh_sdpa_min_tokens: int | None = None, rows_as_decodes: bool = False) -> StepInputs:
    """The step's inputs, its attention metadata built by `backend` (the runner's; a name builds
    one, as tests and benchmarks comparing backends do). `decode_splits` and
    `fresh_sdpa_min_tokens`: see StepLayout. `rows_as_decodes`: chunks verifying drafts and short
    continuations become one decode row per query (fits_decode_rows), so that a CUDA
    graph of decode steps can replay the step; `chunks` of the result stay the scheduled chunks,
    and such a chunk's rows are consecutive, its last at last_token_index."""
    if isinstance(backend, str):
        backend = backend_named(backend)
    window = max_sliding_window(groups)
    decodes, prefills = [], []
    decode_rows: list[StepChunk] = []   # what the backend sees: one token each
    ids: list[int] = []
    last_index: list[int] = []
    for c in chunks:
        if is_decode_row(c, window):   # one token: its position is its start
            decodes.append(c)
            decode_rows.append(c)
            ids.append(token_ids[c.request_id][c.start])
        elif rows_as_decodes and fits_decode_rows(c, window):
            decodes.append(c)
            decode_rows.extend(_decode_rows(c))
            num_known = c.num_tokens - len(c.spec_token_ids)
            ids.extend(token_ids[c.request_id][c.start:c.start + num_known])
            ids.extend(c.spec_token_ids)
        else:
            prefills.append(c)
            continue
        last_index.append(len(ids) - 1)
    ordered = decodes + prefills
    rows = decode_rows + prefills

    pos_parts: list[np.ndarray] = [np.array([c.start for c in decode_rows], dtype=np.int64)]
    prefill_ranges: list[tuple[int, int]] = []
    for chunk in prefills:
        row_start = len(ids)
        num_known = chunk.num_tokens - len(chunk.spec_token_ids)
        ids.extend(token_ids[chunk.request_id][chunk.start:chunk.start + num_known])
        ids.extend(chunk.spec_token_ids)
        pos_parts.append(np.arange(chunk.start, chunk.start + chunk.num_tokens, dtype=np.int64))
        last_index.append(len(ids) - 1)
        prefill_ranges.append((row_start, len(ids)))
    positions = np.concatenate(pos_parts)

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(a), device)   # queued: the device may be busy

    block_tables = [[c.block_ids[group.group_id] for c in rows] for group in groups]
    step = StepLayout(
        decodes=decode_rows, prefills=prefills, prefill_query_ranges=prefill_ranges, groups=groups,
        block_tables=block_tables,
        slot_mappings=[to_dev(_slots(rows, tables, block_size, not sliding_window_of(group)))
                       for group, tables in zip(groups, block_tables)],
        block_size=block_size, layer_to_group=layer_to_group, layer_to_slot=layer_to_slot, kv_caches=kv_caches,
        device=device, decode_splits=decode_splits, fresh_sdpa_min_tokens=fresh_sdpa_min_tokens)
    attention: AttentionMetadata = backend.build_metadata(step)
    return StepInputs(ordered, to_dev(np.asarray(ids, dtype=np.int64)), to_dev(positions),
                      attention, last_index)
