"""The runner's side of pooling requests (embeddings): their vectors from the final hidden states.

A pooling request's prompt may be computed in several chunks (chunked prefill), so its vector
is built as the chunks run: MEAN keeps a running float32 sum of its rows, CLS the row of
position 0, LAST needs only the row of the last prompt token. The step that computes that token
finishes the vector: cut to `dimensions`, then L2-normalized unless `normalize` is off (vLLM's
order). It stays on the device until the step is collected, where it becomes float32 bytes.

The state lives with the runner's request state: a preempted request is dropped and starts
again from its first chunk with a fresh one. Pooling chunks need their rows' hidden states, so a
step that holds one runs eagerly (a CUDA graph returns logits only) with every row kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.pooling_params import PoolingParams


@dataclass
class PoolingState:
    params: PoolingParams          # resolved: pooling_type and normalize set
    num_prompt_tokens: int
    total: torch.Tensor | None = None   # MEAN: float32 sum of the rows computed so far
    first: torch.Tensor | None = None   # CLS: the row of position 0

    def fold(self, start: int, rows: torch.Tensor) -> torch.Tensor | None:
        """Take one chunk's rows (positions start..start + len - 1); returns the finished vector
        when the chunk ends the prompt, else None."""
        kind = self.params.pooling_type
        rows = rows.float()
        if kind == "MEAN":
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
        elif kind == "CLS" and start == 0:
            self.first = rows[0]
        if start + rows.shape[0] < self.num_prompt_tokens:
            return None
        if kind == "MEAN":
            vector = self.total / self.num_prompt_tokens
        elif kind == "CLS":
            vector = self.first
        else:
            vector = rows[-1]
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector


def has_pooling(chunks: Sequence, states: Mapping) -> bool:
    """Whether any chunk of the step is a pooling request's (its rows' hidden states are needed)."""
    return any(getattr(states.get(c.request_id), "pooling", None) is not None for c in chunks)


def pool_step(inputs, hidden: torch.Tensor | None, states: Mapping) -> dict[str, torch.Tensor] | None:
    """Fold every pooling chunk of a forward into its request's state; the vectors of the
    requests whose prompt the step finished (on the device), or None when there are none.
    `hidden` holds every row of the step (the runner keeps them all when a chunk pools)."""
    if inputs is None or hidden is None:
        return None
    finished = {}
    for chunk, last in zip(inputs.chunks, inputs.last_token_index):
        state = states.get(chunk.request_id)
        pooling = getattr(state, "pooling", None)
        if pooling is None:
            continue
        vector = pooling.fold(chunk.start, hidden[last - chunk.num_tokens + 1:last + 1])
        if vector is not None:
            finished[chunk.request_id] = vector
    return finished or None


def pooled_bytes(vectors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """The finished vectors as float32 little-endian bytes (waits for the device)."""
    return {rid: np.asarray(v.detach().to("cpu", torch.float32), dtype="<f4").tobytes() for rid, v in vectors.items()}
