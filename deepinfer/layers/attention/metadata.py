"""Per-step attention inputs, built by the runner once per step and shared by every layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class GroupMetadata:
    """Where one layer group's KV lives for this step's requests."""

    # [num_tokens] flat cache row (block_id * block_size + offset) to write each new token's K/V.
    slot_mapping: torch.Tensor
    # Decode rows (one query token each), batched: [num_decodes, max_kv_len] flat cache rows to
    # read, padded with row 0 of the null block, and an additive bias hiding the padding (None
    # when no row is padded). Each row gathers only its own window, so no causal mask.
    decode_gather: torch.Tensor | None
    decode_bias: torch.Tensor | None     # [num_decodes, 1, 1, max_kv_len]: 0 or -inf
    # Prefill/extend rows, one entry per request: (flat rows to read [kv_len], mask [q_len, kv_len]).
    prefill: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionMetadata:
    num_tokens: int
    # Token ranges of the decode rows (all first, contiguous) and of each prefill row.
    num_decode_tokens: int
    prefill_query_ranges: list[tuple[int, int]]
    groups: list[GroupMetadata]
    layer_to_group: list[int]
    layer_to_slot: list[int]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per slot: (K, V) as [rows, kv_heads, head_dim]


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a forward_context (the runner sets it)")
    return _current
