"""Turns a scheduler plan into the tensors of one forward: token ids, positions, KV addresses.

Rows are ordered decode-first: chunks of exactly one token (a request generating) are batched
into one attention call per layer; longer chunks (prefill, or prefill on top of cached blocks)
are attended one request at a time (the "cpu" backend gathers the decode rows head-major, see
GroupMetadata.decode_head_rows). A chunk verifying speculative drafts has its drafts
(`spec_token_ids`, not yet known to the runner) as its last tokens, and takes the prefill path:
its queries share one gather of the request's KV (as decode rows, each query would gather its
own copy, which costs several times more at batch 64 on the CPU). On the Triton backend the
kernels read the block tables instead of gathered rows, and long prefill chunks that start at
position 0 are attended by SDPA's flash kernel over the step's own K/V (FRESH_SDPA_MIN_TOKENS).
Index arithmetic is done in numpy on the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.layers.attention.metadata import AttentionMetadata, GroupMetadata
from deepinfer.platforms.transfer import to_device
from deepinfer.worker.request_states import StepChunk

# Triton backend: a fresh chunk (one that starts at position 0, so this step holds all its K/V)
# this long or longer attends with SDPA's flash kernel over the step's own K/V; see
# layers/attention/layer.py. Shorter ones stay in the paged prefill kernel, whose one launch
# covers every short chunk of the step: a flash call per short chunk would launch fewer
# programs (128-query tiles x heads) than the GPU has multiprocessors, once per chunk and layer.
FRESH_SDPA_MIN_TOKENS = 512


@dataclass
class StepInputs:
    chunks: list[StepChunk]        # in row order (decodes first)
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # For each chunk, the index of its last token in the flat token axis.
    last_token_index: list[int]


def _window(group: KVCacheGroup) -> int | None:
    return getattr(group.spec, "sliding_window", None)


def _flash_takes(group: KVCacheGroup, device: torch.device) -> bool:
    """Whether SDPA's flash backend takes this group's K/V as they are. On CUDA it wants fp16 or
    bf16 and a head size <= 256 (and pads, i.e. copies, one not a multiple of 8); the CPU's flash
    kernel (Triton's interpreter in tests) takes any."""
    spec = group.spec
    if device.type != "cuda":
        return True
    return spec.dtype in (torch.float16, torch.bfloat16) and spec.head_size <= 256 and spec.head_size % 8 == 0


def _flat_rows(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return block_table[positions // block_size] * block_size + positions % block_size


def padded_block_table(tables: list[list[int]]) -> np.ndarray:
    """Rows of block ids, right-padded with the null block 0, as int32 (what the kernels read).
    Filled in one pass over all ids: a copy per row cost ~3 us, 1.5 ms at 512 rows."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), int(lengths.max(initial=1))), dtype=np.int32)
    total = int(lengths.sum())
    if total:
        out[np.arange(out.shape[1]) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=total)
    return out


def _slots(chunks: list[StepChunk], group_id: int, block_size: int) -> np.ndarray:
    """The cache row of every token of the chunks, in order. A one-token chunk (a decode) is
    looked up directly: numpy per chunk costs more than the lookup, at 512 decodes a step."""
    parts: list[np.ndarray] = []
    singles: list[int] = []
    for c in chunks:
        ids = c.block_ids[group_id]
        if c.num_tokens == 1:
            singles.append(ids[c.start // block_size] * block_size + c.start % block_size)
            continue
        if singles:
            parts.append(np.array(singles, dtype=np.int64))
            singles = []
        parts.append(_flat_rows(np.asarray(ids, dtype=np.int64), np.arange(c.start, c.start + c.num_tokens),
                                block_size))
    if singles:
        parts.append(np.array(singles, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_step_inputs(chunks: list[StepChunk], token_ids: dict[str, list[int]],
                      groups: list[KVCacheGroup], block_size: int, layer_to_group: list[int],
                      layer_to_slot: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device, backend: str = "reference", decode_splits: int = 1,
                      fresh_sdpa_min_tokens: int = FRESH_SDPA_MIN_TOKENS) -> StepInputs:
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

    group_meta = []
    for group in groups:
        window = _window(group)
        slot_mapping = _slots(ordered, group.group_id, block_size)
        if backend == "triton":
            # Plain causal SDPA is exact for a fresh chunk only if no window cuts it: the last
            # query (position n - 1) sees keys > n - 1 - window, i.e. all of them when window >= n.
            # A window that cuts the chunk would need a mask, and flash takes none.
            flash = _flash_takes(group, device)
            sdpa_ranges, kernel_rows = [], []
            for i, (c, token_range) in enumerate(zip(prefills, prefill_ranges)):
                if (flash and c.start == 0 and c.num_tokens >= fresh_sdpa_min_tokens
                        and (not window or window >= c.num_tokens)):
                    sdpa_ranges.append(token_range)
                else:
                    kernel_rows.append(i)
            group_meta.append(GroupMetadata(
                to_dev(slot_mapping), None, None, [],
                block_table=to_dev(padded_block_table([c.block_ids[group.group_id] for c in ordered])),
                sdpa_prefill_ranges=sdpa_ranges,
                kernel_prefill_rows=to_dev(np.array(kernel_rows, dtype=np.int32)) if kernel_rows else None,
                kernel_max_prefill_len=max((prefills[i].num_tokens for i in kernel_rows), default=0)))
            continue

        tables = [np.asarray(c.block_ids[group.group_id], dtype=np.int64) for c in ordered]
        decode_gather = decode_bias = decode_head_rows = None
        if decodes:
            qpos = np.array([c.start for c in decodes], dtype=np.int64)
            lo = np.maximum(qpos - window + 1, 0) if window else np.zeros_like(qpos)
            length = qpos - lo + 1
            span = np.arange(int(length.max()), dtype=np.int64)
            kv_pos = lo[:, None] + span[None, :]
            valid = span[None, :] < length[:, None]
            gather = np.zeros(kv_pos.shape, dtype=np.int64)
            for r, table in enumerate(tables[:len(decodes)]):
                gather[r, :length[r]] = _flat_rows(table, kv_pos[r, :length[r]], block_size)
            if backend == "cpu":
                heads = group.spec.num_kv_heads
                decode_head_rows = to_dev((gather[:, None, :] * heads
                                           + np.arange(heads, dtype=np.int64)[None, :, None]).reshape(-1))
            else:
                decode_gather = to_dev(gather)
            if not valid.all():
                decode_bias = to_dev(np.where(valid, 0.0, -np.inf).astype(np.float32)[:, None, None, :])

        prefill_meta = []
        for c, table in zip(prefills, tables[len(decodes):]):
            q = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            lo = max(c.start - window + 1, 0) if window else 0
            kv = np.arange(lo, c.start + c.num_tokens, dtype=np.int64)
            mask = kv[None, :] <= q[:, None]
            if window:
                mask &= kv[None, :] > q[:, None] - window
            prefill_meta.append((to_dev(_flat_rows(table, kv, block_size)), to_dev(mask)))
        group_meta.append(GroupMetadata(to_dev(slot_mapping), decode_gather, decode_bias, prefill_meta,
                                        decode_head_rows=decode_head_rows))

    attention = AttentionMetadata(
        num_tokens=len(ids), num_decode_tokens=len(decodes), prefill_query_ranges=prefill_ranges,
        groups=group_meta, layer_to_group=layer_to_group, layer_to_slot=layer_to_slot,
        kv_caches=kv_caches, block_size=block_size, backend=backend)
    if backend == "triton":
        attention.seq_lens = to_dev(np.array([c.start + c.num_tokens for c in ordered], dtype=np.int32))
        lengths = [c.num_tokens for c in prefills]
        attention.prefill_query_start = to_dev(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        attention.num_decode_splits = decode_splits
    return StepInputs(ordered, to_dev(np.asarray(ids, dtype=np.int64)), to_dev(positions),
                      attention, last_index)
