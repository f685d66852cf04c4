"""The steps a model runner runs at start, before any request, on throwaway KV caches.

  profile_peak_memory   the largest step the scheduler may plan, so that the memory query that
                        sizes the real KV pool sees the activation peak, not only the weights
  warm_up               the attention backend's warm-up steps (AttentionBackend.warm_up_steps),
                        so that kernels compile at start, not in the first steps that serve; for a
                        model that reads images, the prefill steps again with rows that see later
                        keys, as an image's tokens do (AttentionBackend.with_visible_end)

Both build their steps as a real one is built (input_batch.build_step_inputs) and run the model
eagerly; the caches they write are freed once the step has run.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.kv_cache.tensors import KVLayout
from deepinfer.layers.attention import forward_context
from deepinfer.layers.attention.backends import AttentionBackend
from deepinfer.platforms import Platform
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk, release_model_state


class StartUpSteps:
    """Throwaway steps of one model over caches laid out as its real KV pool."""

    def __init__(self, model: torch.nn.Module, kv_layout: KVLayout, block_size: int,
                 backend: AttentionBackend, platform: Platform) -> None:
        self.model = model
        self.kv_layout = kv_layout
        self.block_size = block_size
        self.backend = backend
        self.platform = platform

    def _scratch_caches(self, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A throwaway KV cache of `blocks` blocks per slot, for steps run before the real pool
        exists (K and V share one tensor: nothing reads them back)."""
        return self.kv_layout.allocate(blocks, self.platform.device, share_kv=True)

    def _inputs(self, chunks: list[StepChunk], token_ids: dict[str, list[int]], caches, **kwargs):
        layout = self.kv_layout
        return build_step_inputs(chunks, token_ids, layout.groups, self.block_size, layout.layer_to_group,
                                 layout.layer_to_slot, caches, self.platform.device, backend=self.backend,
                                 **kwargs)

    @torch.inference_mode()
    def profile_peak_memory(self, tokens: int, rows: int) -> None:
        """Run a prefill of `tokens` tokens, then logits and sampling's largest temporary for
        `rows` rows (max_num_batched_tokens and max_num_seqs, both within max_model_len)."""
        blocks = -(-tokens // self.block_size) + 1
        caches = self._scratch_caches(blocks)
        chunk = StepChunk("profile", 0, tokens, [list(range(1, blocks)) for _ in self.kv_layout.groups], sample=True)
        inputs = self._inputs([chunk], {"profile": [0] * tokens}, caches)
        with forward_context(inputs.attention):
            hidden = self.model(inputs.input_ids, inputs.positions)
        release_model_state(chunk.model_state)
        logits = self.model.compute_logits(hidden[:rows])
        torch.softmax(logits, dim=-1).sum().item()      # the sampler's largest temporary
        del caches, inputs, hidden, logits
        self.platform.synchronize()
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def warm_up(self, max_model_len: int, decode_splits: int) -> None:
        """One eager step for each of the backend's warm-up steps; `decode_splits`: the runner's
        split count for a batch of one row."""
        steps = self.backend.warm_up_steps(max_model_len)
        for tokens in steps:
            self._warm_up_step(tokens, decode_splits)
        if hasattr(self.model, "encode_images"):   # the encoder stage: RunnerImages.for_model
            # A step with an image's rows runs other variants of the prefill kernels (the Triton
            # backend's visible ends, compiled per window and split like the rest): each step again,
            # every prefill row seeing to its chunk's end, so that they compile here too.
            for tokens in steps:
                self._warm_up_step(tokens, decode_splits, see_ahead=True)

    def _warm_up_step(self, tokens: list[tuple[int, int]], decode_splits: int, see_ahead: bool = False) -> None:
        blocks = sum(-(-(c + n) // self.block_size) for c, n in tokens) + 1
        caches = self._scratch_caches(blocks)
        chunks, token_ids, next_block = [], {}, 1
        for i, (cached, new) in enumerate(tokens):
            count = -(-(cached + new) // self.block_size)
            table = list(range(next_block, next_block + count))
            next_block += count
            chunks.append(StepChunk(f"warm-up {i}", cached, new, [table for _ in self.kv_layout.groups], sample=True))
            token_ids[f"warm-up {i}"] = [0] * (cached + new)
        inputs = self._inputs(chunks, token_ids, caches, decode_splits=decode_splits)
        meta = inputs.attention
        if see_ahead and meta.step is not None and meta.step.prefills:
            prefills = meta.step.prefills
            ends = np.concatenate([np.full(c.num_tokens, c.start + c.num_tokens, dtype=np.int32) for c in prefills])
            meta = self.backend.with_visible_end(meta, ends, list(range(len(prefills)))) or meta
        with forward_context(meta):
            self.model(inputs.input_ids, inputs.positions)
        for chunk in chunks:   # throwaway requests: what the model took for them goes back
            release_model_state(chunk.model_state)
        self.platform.synchronize()
