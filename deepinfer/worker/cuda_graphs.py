"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with fresh inputs.

A decode step of a 32-layer model launches several hundred small kernels; at batch 1 the GPU
would spend most of the step waiting for Python to launch them. A graph records the launches
once and replays them for the price of one.

What a graph may see: only tensors that live as long as it does. So every per-step input
(token ids, positions, KV lengths, KV write rows, block tables) has one static buffer sized for
the largest bucket, and a step copies its values into the front of those buffers; the graph of
the smallest bucket >= the batch replays, with the padding rows set to length 0 (the decode
kernel skips them) and to write into the null block. Per-request state (the KV cache, the
requests' token lists, the sampler's RNGs) stays outside, where it already lives.

Prefill and mixed steps run eagerly: their shapes vary too much for graphs to pay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.layers.attention import AttentionMetadata, forward_context
from deepinfer.layers.attention.metadata import GroupMetadata
from deepinfer.layers.attention.triton_decode import num_splits_for

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(self, model, num_groups: int, num_kv_heads: int, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, layer_to_group: list[int], layer_to_slot: list[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.layer_to_group, self.layer_to_slot, self.kv_caches = layer_to_group, layer_to_slot, kv_caches
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.slot_mappings = [torch.zeros(b, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.block_tables = [torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.graphs: dict[int, _Graph] = {}

    def splits(self, batch: int) -> int:
        return num_splits_for(batch, self.num_kv_heads, self.num_sms)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        groups = [GroupMetadata(slots[:bucket], None, None, [], block_table=table[:bucket])
                  for slots, table in zip(self.slot_mappings, self.block_tables)]
        return AttentionMetadata(
            num_tokens=bucket, num_decode_tokens=bucket, prefill_query_ranges=[], groups=groups,
            layer_to_group=self.layer_to_group, layer_to_slot=self.layer_to_slot, kv_caches=self.kv_caches,
            block_size=self.block_size, backend="triton", seq_lens=self.seq_lens[:bucket],
            num_decode_splits=self.splits(bucket))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket, largest first so the smaller ones reuse its memory pool."""
        # Capture-time inputs: length-1 sequences reading and writing row 0 of the null block.
        self.seq_lens.fill_(1)
        pool = None
        for bucket in reversed(self.buckets):
            meta = self._metadata(bucket)
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            with forward_context(meta):   # warm-up: Triton compiles and autotunes outside capture
                self.model.compute_logits(self.model(ids, pos))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # A fresh view of the positions: the rotary layer caches its cos/sin rows per positions
            # tensor object, and the rows cached by the warm-up must not be baked into the graph.
            pos = self.positions[:bucket]
            with torch.cuda.graph(graph, pool=pool), forward_context(meta):
                logits = self.model.compute_logits(self.model(ids, pos))
            pool = graph.pool()
            self.graphs[bucket] = _Graph(graph, logits)
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    def bucket_for(self, batch: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= batch:
                return bucket
        return None

    def run(self, inputs) -> torch.Tensor:
        """Logits [batch, vocab] of a decode-only step (StepInputs built for the triton backend)."""
        meta: AttentionMetadata = inputs.attention
        batch = meta.num_tokens
        bucket = self.bucket_for(batch)
        assert bucket is not None and meta.num_decode_tokens == batch
        self.input_ids[:batch].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:batch].copy_(inputs.positions, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        for g, group in enumerate(meta.groups):
            self.slot_mappings[g][:batch].copy_(group.slot_mapping, non_blocking=True)
            width = group.block_table.shape[1]
            self.block_tables[g][:batch, :width].copy_(group.block_table, non_blocking=True)
        if bucket > batch:   # padding rows: nothing to attend to, writes land in the null block
            self.seq_lens[batch:bucket].zero_()
            for slots in self.slot_mappings:
                slots[batch:bucket].zero_()
        entry = self.graphs[bucket]
        entry.graph.replay()
        return entry.logits[:batch]
