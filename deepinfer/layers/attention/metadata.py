"""Per-step attention inputs, built by the runner once per step and shared by every layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

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
    # CPU backend (attention/cpu_decode.py): the decode rows' gather again, head-major: for decode
    # row b, KV head h and position i, the row (decode_gather[b, i] * kv_heads + h) of the cache
    # viewed as [rows * kv_heads, head_dim], flattened [num_decodes * kv_heads * max_kv_len]. One
    # index_select then yields K as [num_decodes * kv_heads, max_kv_len, head_dim], the layout
    # one batched matmul takes without a copy. decode_gather itself is None then.
    decode_head_rows: torch.Tensor | None = None
    # Triton backend: [num_seqs, max_blocks] int32 block ids per row (decodes first), 0-padded.
    # The reference fields above are left empty then, and this one is None for the reference.
    block_table: torch.Tensor | None = None
    # Triton backend, how this group's prefill rows are attended (a group's sliding window
    # decides, so it is per group). Fresh chunks (the chunk starts at position 0, is long enough
    # to fill the GPU, and no window cuts it) attend over this step's own K/V with SDPA's flash
    # kernel: their token ranges in the step, on the host. Every other prefill row goes to the
    # paged prefill kernel: their indices among the prefill rows [n] int32 (None: there are
    # none) and the longest of those chunks (the kernel's grid).
    sdpa_prefill_ranges: list[tuple[int, int]] = field(default_factory=list)
    kernel_prefill_rows: torch.Tensor | None = None
    kernel_max_prefill_len: int = 0


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
    block_size: int = 16
    # "reference" (plain PyTorch, the fields of GroupMetadata above), "cpu" (the CPU fast path:
    # the reference's fields, decodes through decode_head_rows) or "triton" (the kernels in
    # triton_decode.py / triton_prefill.py, which read the block tables directly).
    backend: str = "reference"
    # Triton backend, shared by every group: KV length per row including this step's tokens
    # [num_seqs] int32 (decodes first), where each prefill row starts in q counted from the
    # first prefill token [num_prefills + 1] int32, and the number of sequence splits of the
    # decode kernel (fixed per batch size so CUDA graphs stay valid).
    seq_lens: torch.Tensor | None = None
    prefill_query_start: torch.Tensor | None = None
    num_decode_splits: int = 1


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


def current_backend() -> str | None:
    """The attention backend of the forward in progress, or None outside a forward_context.

    Layers other than attention read it to pick their fast path (see deepinfer/layers/fused/)."""
    return None if _current is None else _current.backend
