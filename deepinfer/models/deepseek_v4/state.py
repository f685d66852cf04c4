"""What a DeepSeek-V4 request keeps between forward calls (the reference path's KV "cache").

One `V4State` per batch of requests that advance together (the reference runs one request, or
several of equal length, per call). Every tensor has the batch on axis 0. Per attention layer:

* `window`: the K=V rows (one shared head, after kv_norm and rope) of the last
  `sliding_window - 1` tokens; the next query's window is these plus itself.
* `compressor` (CSA and HCA layers): the compressed rows emitted so far, one per `rate` tokens,
  plus the partial state of the block still filling up (see CompressorState).
* `indexer` (CSA layers only): the same again at `index_head_dim`: the Lightning Indexer's own
  compressed keys and its partial block.

docs/deepseek_v4.md#what-a-request-keeps sizes each kind for V4-Flash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """A compressor's running state. `rows` only grows; the rest is bounded by `rate`."""
    # Projections (kv_proj / gate_proj outputs, gate without position_bias) of the tokens
    # since the last complete block: [B, < rate, width], width = 2 * dim when blocks overlap.
    pending_kv: torch.Tensor | None = None
    pending_gate: torch.Tensor | None = None
    # Overlapping compressors only (CSA and its indexer): the first half ("Ca") of the last
    # complete block's kv and gate (gate with position_bias added), [B, rate, dim]; the next
    # block's row pools over them too.
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    # Compressed rows so far, normed and rotated at position row_index * rate: [B, rows, dim].
    rows: torch.Tensor | None = None
    # Rows that exist before `rows` but are not held (the paged kernel path reads them from the
    # KV pages): `rows` then holds rows skipped_rows .. num_rows - 1 only.
    skipped_rows: int = 0
    # The last call's own tokens' projections (kv, gate without position_bias), [B, L, width]:
    # not state, but what a paged cache keeps of them (models/deepseek_v4/paged.py).
    call_kv: torch.Tensor | None = None
    call_gate: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.skipped_rows + (0 if self.rows is None else self.rows.shape[1])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.pending_kv, self.pending_gate, self.prev_kv, self.prev_gate, self.rows)
                if t is not None]


@dataclass
class LayerState:
    window: torch.Tensor | None = None            # [B, <= sliding_window - 1, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    # The last call's own tokens' K=V rows [B, L, head_dim]: not state (the window keeps what
    # later queries need), but what a paged cache writes (models/deepseek_v4/paged.py).
    call_rows: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = [] if self.window is None else [self.window]
        for part in (self.compressor, self.indexer):
            if part is not None:
                out += part.tensors()
        return out


@dataclass
class V4State:
    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)
    seen: int = 0                                  # tokens already run through the main layers

    @classmethod
    def empty(cls, layer_types: list[str], mtp_layer_types: list[str] = ()) -> V4State:
        def fresh(kind: str) -> LayerState:
            from deepinfer.models.deepseek_v4.config import CSA, SLIDING
            return LayerState(compressor=None if kind == SLIDING else CompressorState(),
                              indexer=CompressorState() if kind == CSA else None)
        return cls([fresh(t) for t in layer_types], [fresh(t) for t in mtp_layer_types])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers + self.mtp for t in layer.tensors())
