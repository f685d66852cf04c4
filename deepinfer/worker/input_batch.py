"""Turns a scheduler plan into the tensors of one forward: token ids, positions, KV addresses.

Rows are ordered decode-first: chunks of exactly one token (a request generating) are batched
into one attention call per layer; longer chunks (prefill, or prefill on top of cached blocks)
follow. A chunk verifying speculative drafts has its drafts (`spec_token_ids`, not yet known to
the runner) as its last tokens, and takes the prefill path: its queries share one gather of the
request's KV (as decode rows, each query would gather its own copy, which costs several times
more at batch 64 on the CPU). This file lays the step out (ids, positions, each token's KV write
row) the same way for every backend; the step's attention backend then builds its own metadata
from that layout (layers/attention/backends/: gathered rows for the reference and CPU backends,
block tables for the Triton kernels). Index arithmetic is done in numpy on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.layers.attention.backends import AttentionBackend, AttentionMetadata, StepLayout, backend_named
from deepinfer.layers.attention.backends.base import flat_rows
from deepinfer.platforms.transfer import to_device
from deepinfer.worker.request_states import StepChunk


@dataclass
class StepInputs:
    chunks: list[StepChunk]        # in row order (decodes first)
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # For each chunk, the index of its last token in the flat token axis.
    last_token_index: list[int]


def _slots(chunks: list[StepChunk], tables: list[list[int]], block_size: int) -> np.ndarray:
    """The cache row of every token of the chunks, in order (tables: each chunk's block ids). A
    one-token chunk (a decode) is looked up directly: numpy per chunk costs more than the lookup,
    at 512 decodes a step."""
    parts: list[np.ndarray] = []
    singles: list[int] = []
    for c, ids in zip(chunks, tables):
        if c.num_tokens == 1:
            singles.append(ids[c.start // block_size] * block_size + c.start % block_size)
            continue
        if singles:
            parts.append(np.array(singles, dtype=np.int64))
            singles = []
        parts.append(flat_rows(np.asarray(ids, dtype=np.int64), np.arange(c.start, c.start + c.num_tokens),
                               block_size))
    if singles:
        parts.append(np.array(singles, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_step_inputs(chunks: list[StepChunk], token_ids: dict[str, list[int]],
                      groups: list[KVCacheGroup], block_size: int, layer_to_group: list[int],
                      layer_to_slot: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device, backend: AttentionBackend | str, decode_splits: int = 1,
                      fresh_sdpa_min_tokens: int | None = None) -> StepInputs:
    """The step's inputs, its attention metadata built by `backend` (the runner's; a name builds
    one, as tests and benchmarks comparing backends do). `decode_splits` and
    `fresh_sdpa_min_tokens`: see StepLayout."""
    if isinstance(backend, str):
        backend = backend_named(backend)
    decodes = [c for c in chunks if c.num_tokens == 1 and not c.prompt_logprobs]
    prefills = [c for c in chunks if not (c.num_tokens == 1 and not c.prompt_logprobs)]
    ordered = decodes + prefills

    ids: list[int] = []
    pos_parts: list[np.ndarray] = []
    last_index: list[int] = []
    prefill_ranges: list[tuple[int, int]] = []
    for chunk in decodes:   # one token each: its position is its start
        ids.append(token_ids[chunk.request_id][chunk.start])
    last_index.extend(range(len(decodes)))
    pos_parts.append(np.array([c.start for c in decodes], dtype=np.int64))
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

    block_tables = [[c.block_ids[group.group_id] for c in ordered] for group in groups]
    step = StepLayout(
        decodes=decodes, prefills=prefills, prefill_query_ranges=prefill_ranges, groups=groups,
        block_tables=block_tables,
        slot_mappings=[to_dev(_slots(ordered, tables, block_size)) for tables in block_tables],
        block_size=block_size, layer_to_group=layer_to_group, layer_to_slot=layer_to_slot, kv_caches=kv_caches,
        device=device, decode_splits=decode_splits, fresh_sdpa_min_tokens=fresh_sdpa_min_tokens)
    attention: AttentionMetadata = backend.build_metadata(step)
    return StepInputs(ordered, to_dev(np.asarray(ids, dtype=np.int64)), to_dev(positions),
                      attention, last_index)
