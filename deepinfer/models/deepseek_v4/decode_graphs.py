"""DeepSeek-V4's part of the CUDA graphs of decode steps (worker/cuda_graphs.py replays them).

A V4 decode step needs no host work inside its forward (paged_kernels.py, step_compressor.py),
so one captured graph per batch bucket replays it, reading these static buffers: per row its
chunk (the row itself), position, window floor, ring slot and segment (every decode row is its
own segment, except the rows of one chunk verifying drafts), write floor, and per KV group the
rows' block tables and KV write rows. A step copies its metadata into their first rows; the
rows past its batch are padding: position 0, slot 0 (the rings' padding slot), block tables of
the null block, so whatever they write lands where nothing reads.

What the host decides per step on an eager step, a graph decides per row on the device: every
row pools a compressed block and saves a KV block's tail, and the writes of the rows that
complete none go to the null block; every compressed row a token reads is in the pages by then
(first_new past any row); the indexer scores as many rows as GRAPH_CONTEXT (or max_model_len,
if shorter) holds, and a step reaching past that runs eagerly (`accepts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.attention.backends.base import AttentionMetadata, DecodeGraphBuffers, GroupMetadata
from deepinfer.models.deepseek_v4.rings import ProjectionRings
from deepinfer.models.deepseek_v4.step_compressor import ALL_IN_PAGES
from deepinfer.models.deepseek_v4.step_metadata import V4KernelMetadata

# The longest context a graph replays: its indexer scores this many positions' rows for every
# token (a [batch, GRAPH_CONTEXT / 4] sort per CSA layer), so a 1M-token max_model_len does not
# make every decode step sort 262k scores; longer contexts' steps run eagerly, scoring their own.
GRAPH_CONTEXT = 65536

# The per-row fields copied from a step's metadata into the buffers, with their padding value
# (None: the row's own index).
ROW_FIELDS = {"tok_chunk": None, "tok_pos": 0, "tok_floor": 0, "tok_slot": 0, "seg_start": 0, "seg_row": None,
              "seg_end": 1, "tok_write_floor": 0}


@dataclass(kw_only=True)
class V4GraphMetadata(V4KernelMetadata):
    """A graph bucket's metadata: the answers V4KernelMetadata takes from the host, fixed."""

    all_rows: torch.Tensor
    first_new_all: torch.Tensor
    new_off_all: torch.Tensor
    max_positions: int

    def window_low(self, window: int) -> torch.Tensor:
        # Not cached: the graph's warm-up run and its capture must each compute it from the buffers.
        return torch.maximum(torch.clamp_min(self.tok_pos - (window - 1), 0), self.tok_floor).to(torch.int32)

    def pooling_rows(self, rate: int) -> torch.Tensor:
        return self.all_rows

    def tail_rows(self) -> torch.Tensor:
        return self.all_rows

    def new_row_starts(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first_new_all, self.new_off_all

    def rows_bound(self, rate: int) -> int:
        return self.max_positions // rate


class V4GraphBuffers(DecodeGraphBuffers):
    def __init__(self, backend, rings: ProjectionRings, num_groups: int, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, layer_to_group: list[int], layer_to_slot: list[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.backend, self.rings = backend, rings
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.max_positions = min(max_blocks_per_seq * block_size, GRAPH_CONTEXT)
        self.layer_to_group, self.layer_to_slot, self.kv_caches = layer_to_group, layer_to_slot, kv_caches
        b = max_batch
        self.rows = {name: torch.zeros(b, dtype=torch.int32 if name in ("tok_chunk", "tok_pos", "tok_floor")
                                       else torch.long, device=device) for name in ROW_FIELDS}
        self.tables = [torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.slot_mappings = [torch.zeros(b, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.all_rows = torch.arange(b, device=device)
        self.first_new = torch.full((b,), ALL_IN_PAGES, dtype=torch.int32, device=device)
        self.new_off = torch.zeros(b, dtype=torch.int32, device=device)
        self._pad_from(0)

    def _pad_from(self, n: int) -> None:
        for name, value in ROW_FIELDS.items():
            self.rows[name][n:] = self.all_rows[n:] if value is None else value
        for table, mapping in zip(self.tables, self.slot_mappings):
            table[n:] = 0
            mapping[n:] = 0

    def metadata(self, bucket: int) -> AttentionMetadata:
        return V4GraphMetadata(
            backend=self.backend, num_tokens=bucket, num_decode_tokens=bucket, prefill_query_ranges=[],
            groups=[GroupMetadata(slot_mapping=m[:bucket]) for m in self.slot_mappings],
            layer_to_group=self.layer_to_group, layer_to_slot=self.layer_to_slot, kv_caches=self.kv_caches,
            block_size=self.block_size, rings=self.rings, tables=[t[:bucket] for t in self.tables],
            **{name: t[:bucket] for name, t in self.rows.items()}, all_rows=self.all_rows[:bucket],
            first_new_all=self.first_new[:bucket], new_off_all=self.new_off[:bucket],
            max_positions=self.max_positions)

    def accepts(self, chunks) -> bool:
        return all(c.start + c.num_tokens <= self.max_positions for c in chunks)

    def fill_for_capture(self) -> None:
        self._pad_from(0)

    def clear_after_capture(self) -> None:
        self._pad_from(0)

    def load(self, meta: AttentionMetadata, bucket: int) -> None:
        assert isinstance(meta, V4KernelMetadata)
        n = meta.num_tokens
        for name in ROW_FIELDS:
            self.rows[name][:n].copy_(getattr(meta, name), non_blocking=True)
        for table, mapping, step_table, group in zip(self.tables, self.slot_mappings, meta.tables, meta.groups):
            table[:n, :step_table.shape[1]].copy_(step_table[:n], non_blocking=True)
            mapping[:n].copy_(group.slot_mapping, non_blocking=True)
        self._pad_from(n)
