"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with fresh inputs.

A decode step of a 32-layer model launches several hundred small kernels; at batch 1 the GPU
would spend most of the step waiting for Python to launch them. A graph records the launches
once and replays them for the price of one.

What a graph may see: only tensors that live as long as it does. So every per-step input
(token ids, positions here; KV lengths, KV write rows, block tables in the attention backend's
DecodeGraphBuffers) has one static buffer sized for the largest bucket, and a step copies its
values into the front of those buffers; the graph of the smallest bucket >= the batch replays,
with the padding rows made harmless (for the Triton backend: length 0, which the decode kernel
skips, and writes into the null block). Per-request state (the KV cache, the requests' token
lists, the sampler's RNGs) stays outside, where it already lives.

Speculative decoding's verify steps replay the same graphs: a request verifying m drafts is laid
out as 1 + m decode rows (input_batch.fits_decode_rows), row j attending up to its own
position, so the bucket is chosen by rows, not requests, and the graph returns every row's
logits. (Run eagerly, a verify step of the 135M model cost many times a plain decode step on the
GPU whatever its shape, launch-bound; in a graph it costs a decode step of that many rows:
docs/benchmarks/design-measurements.md#verify-step-run-eagerly.)

LoRA adapters (lora/): with enable_lora the graphs are captured with the adapters' products in
them, reading each row's slot from one more static buffer (`lora_slots`), filled per step like
the token ids (0, the base model's zeros, for base rows and padding). The adapters' weights are
slots of stacks changed in place (lora/slots.py), so a graph sees an adapter placed after capture.

Prefill and mixed steps run eagerly: their shapes vary too much for graphs to pay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.layers.attention import AttentionMetadata, forward_context
from deepinfer.layers.attention.backends import AttentionBackend
from deepinfer.lora.slots import step_rows

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
    def __init__(self, model, backend: AttentionBackend, num_groups: int, num_kv_heads: int, max_batch: int,
                 max_blocks_per_seq: int, block_size: int, layer_to_group: list[int], layer_to_slot: list[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 lora: bool = False) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        # Each row's LoRA slot (lora=True: adapters attached); None: the graphs hold no LoRA products.
        self.lora_slots = torch.zeros(b, dtype=torch.long, device=device) if lora else None
        self.attention_buffers = backend.decode_graph_buffers(
            num_groups=num_groups, max_batch=b, max_blocks_per_seq=max_blocks_per_seq, num_kv_heads=num_kv_heads,
            block_size=block_size, layer_to_group=layer_to_group, layer_to_slot=layer_to_slot,
            kv_caches=kv_caches, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0   # steps replayed (tests check that a path really ran in graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket, largest first so the smaller ones reuse its memory pool."""
        self.attention_buffers.fill_for_capture()
        pool = None
        for bucket in reversed(self.buckets):
            meta = self.attention_buffers.metadata(bucket)
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            lora_rows = self.lora_slots[:bucket] if self.lora_slots is not None else None
            # warm-up: Triton compiles and autotunes outside capture
            with forward_context(meta), step_rows(lora_rows):
                self.model.compute_logits(self.model(ids, pos))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # A fresh view of the positions: the rotary layer caches its cos/sin rows per positions
            # tensor object, and the rows cached by the warm-up must not be baked into the graph.
            pos = self.positions[:bucket]
            with torch.cuda.graph(graph, pool=pool), forward_context(meta), step_rows(lora_rows):
                logits = self.model.compute_logits(self.model(ids, pos))
            pool = graph.pool()
            self.graphs[bucket] = _Graph(graph, logits)
        self.attention_buffers.clear_after_capture()
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    def bucket_for(self, batch: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= batch:
                return bucket
        return None

    def can_advance(self) -> bool:
        """Whether the backend's buffers can move a step's rows forward on the device (verify chains)."""
        return hasattr(self.attention_buffers, "advance")

    def replay_advanced(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay the last run's bucket for the same rows of the same requests, at new token ids
        and positions (device tensors, [rows]): a verify chain's next step
        (worker/spec/verify_chain.py). Returns the rows' logits. The rows' LoRA slots stay those
        the last run filled in: the same requests, the same adapters."""
        rows = input_ids.shape[0]
        bucket = self.bucket_for(rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.attention_buffers.advance(positions)
        entry = self.graphs[bucket]
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits[:rows]

    def run(self, inputs) -> torch.Tensor:
        """Logits [rows, vocab] of a step of decode rows only (StepInputs built by the graphs'
        backend; verifying chunks laid out as decode rows)."""
        meta: AttentionMetadata = inputs.attention
        batch = meta.num_tokens
        bucket = self.bucket_for(batch)
        assert bucket is not None and meta.num_decode_tokens == batch
        self.input_ids[:batch].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:batch].copy_(inputs.positions, non_blocking=True)
        if self.lora_slots is not None:   # padding rows (and a step without adapters) take slot 0
            self.lora_slots[:bucket].zero_()
            if inputs.lora_slots is not None:
                self.lora_slots[:batch].copy_(inputs.lora_slots, non_blocking=True)
        self.attention_buffers.load(meta, bucket)
        entry = self.graphs[bucket]
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits[:batch]
