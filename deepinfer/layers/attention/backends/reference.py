"""The reference backend: plain PyTorch on any device, what the fast paths are tested against.

Each row's keys are gathered from the cache by flat row index, computed on the host: decode rows
(one query each) batched into one gather and two matmuls per layer (Attention._decode), each
prefill chunk (or chunk verifying draft tokens) attended alone with a boolean mask
(Attention._sdpa). A request's window floor (SWA Bounded Replay) cuts only prefill rows' sliding
windows: input_batch.py sends every row whose window it still cuts down that path. Rows that see
later keys (an image's tokens, with_visible_end) get them ORed into their chunk's mask. Turns on no
faster op: norms, rotary, activation and projections all run the reference code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.kv_cache.dtypes import read_cache_rows, write_cache_rows
from deepinfer.layers.attention.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupMetadata,
    StepLayout,
    flat_rows,
    sliding_window_of,
)


@dataclass(kw_only=True)
class GatherGroupMetadata(GroupMetadata):
    """One group's KV as gathered rows (the reference and the CPU backend)."""

    # Decode rows, batched: [num_decodes, max_kv_len] flat cache rows to read, padded with row 0
    # of the null block, and an additive bias hiding the padding (None when no row is padded).
    # Each row gathers only its own window, so no causal mask.
    decode_gather: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None      # [num_decodes, 1, 1, max_kv_len]: 0 or -inf
    # CPU backend (attention/cpu_decode.py): the decode rows' gather again, head-major: for decode
    # row b, KV head h and position i, the row (decode_gather[b, i] * kv_heads + h) of the cache
    # viewed as [rows * kv_heads, head_dim], flattened [num_decodes * kv_heads * max_kv_len]. One
    # index_select then yields K as [num_decodes * kv_heads, max_kv_len, head_dim], the layout
    # one batched matmul takes without a copy. decode_gather itself is None then.
    decode_head_rows: torch.Tensor | None = None
    # CPU backend, where every layer's V cache directly follows its K cache in memory (kv_paired):
    # decode_head_rows lists the K rows, then the same rows of V (offset by the K cache's size).
    decode_kv_paired: bool = False
    # Prefill/extend rows, one entry per request: (flat rows to read [kv_len], mask [q_len, kv_len]).
    prefill: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def build_metadata(self, step: StepLayout) -> AttentionMetadata:
        groups = [self._group_metadata(step, i) for i in range(len(step.groups))]
        return AttentionMetadata(groups=groups, **step.metadata_fields(self))

    def _group_metadata(self, step: StepLayout, index: int) -> GatherGroupMetadata:
        group, block_size = step.groups[index], step.block_size
        window = sliding_window_of(group)
        tables = [np.asarray(t, dtype=np.int64) for t in step.block_tables[index]]
        meta = GatherGroupMetadata(slot_mapping=step.slot_mappings[index])
        decodes = step.decodes
        if decodes:
            qpos = np.array([c.start for c in decodes], dtype=np.int64)
            lo = np.maximum(qpos - window + 1, 0) if window else np.zeros_like(qpos)
            length = qpos - lo + 1
            span = np.arange(int(length.max()), dtype=np.int64)
            kv_pos = lo[:, None] + span[None, :]
            valid = span[None, :] < length[:, None]
            gather = np.zeros(kv_pos.shape, dtype=np.int64)
            for r, table in enumerate(tables[:len(decodes)]):
                gather[r, :length[r]] = flat_rows(table, kv_pos[r, :length[r]], block_size)
            self._set_decode_rows(meta, gather, group, step)
            if not valid.all():
                meta.decode_bias = step.to_device(np.where(valid, 0.0, -np.inf).astype(np.float32)[:, None, None, :])

        for c, table in zip(step.prefills, tables[len(decodes):]):
            q = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            # A sliding window stops at the request's window floor: the rows below it were
            # never rebuilt (SWA Bounded Replay). Full-attention groups read every cached row.
            lo = max(c.start - window + 1, c.window_floor, 0) if window else 0
            kv = np.arange(lo, c.start + c.num_tokens, dtype=np.int64)
            mask = kv[None, :] <= q[:, None]
            if window:
                mask &= kv[None, :] > q[:, None] - window
            meta.prefill.append((step.to_device(flat_rows(table, kv, block_size)), step.to_device(mask)))
        return meta

    def with_visible_end(self, meta: AttentionMetadata, visible_end: np.ndarray,
                         chunks: list[int]) -> AttentionMetadata:
        """The chunks' masks ORed with the keys ahead of each row that it sees (q < kv <
        visible_end[q]); the window and floor bound keys from below, so they hide none of them.
        A chunk's keys are positions [end - kv_len, end), ending with its own rows."""
        step, n_dec = meta.step, meta.num_decode_tokens
        ahead: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}   # chunk -> (q positions, visible ends, end)
        for j in chunks:
            row_start, row_end = meta.prefill_query_ranges[j]
            start = step.prefills[j].start
            end = start + row_end - row_start
            ahead[j] = (np.arange(start, end, dtype=np.int64), visible_end[row_start - n_dec:row_end - n_dec], end)
        groups = []
        for group in meta.groups:
            prefill = list(group.prefill)
            for j, (q, limit, end) in ahead.items():
                rows, mask = prefill[j]
                kv = np.arange(end - mask.shape[1], end, dtype=np.int64)
                more = (kv[None, :] > q[:, None]) & (kv[None, :] < limit[:, None])
                prefill[j] = (rows, mask | step.to_device(more))
            groups.append(dataclasses.replace(group, prefill=prefill))
        return dataclasses.replace(meta, groups=groups)

    def _set_decode_rows(self, meta: GatherGroupMetadata, gather: np.ndarray, group, step: StepLayout) -> None:
        """How the decode rows' gather [num_decodes, max_kv_len] reaches attention: token-major here."""
        meta.decode_gather = step.to_device(gather)

    def write_kv(self, layer, meta, group, q, k, v, positions, rotary, k_cache, v_cache):
        if rotary is not None:
            q, k = rotary(positions, q, k)
        write_cache_rows(k_cache, group.slot_mapping, k)
        write_cache_rows(v_cache, group.slot_mapping, v)
        return q, k

    def attend(self, layer, meta, group, q, k, v, k_cache, v_cache):
        n_dec = meta.num_decode_tokens
        decoded = self._attend_decodes(layer, group, q[:n_dec], k_cache, v_cache) if n_dec else None
        if n_dec == q.shape[0]:   # a decode-only step: no copy into `out`
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:n_dec] = decoded
        for (start, end), (rows, mask) in zip(meta.prefill_query_ranges, group.prefill):
            keys = read_cache_rows(k_cache, rows, q.dtype).unsqueeze(0)
            values = read_cache_rows(v_cache, rows, q.dtype).unsqueeze(0)
            out[start:end] = layer._sdpa(q[start:end].unsqueeze(0), keys, values, mask.unsqueeze(0)).squeeze(0)
        return out

    def _attend_decodes(self, layer, group: GatherGroupMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor) -> torch.Tensor:
        """The decode rows q [num_decodes, heads, head_dim] over their gathered keys."""
        keys = read_cache_rows(k_cache, group.decode_gather, q.dtype)
        values = read_cache_rows(v_cache, group.decode_gather, q.dtype)
        return layer._decode(q, keys, values, group.decode_bias)
