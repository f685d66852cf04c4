"""What every attention backend answers, and the step layout it builds its metadata from.

A backend is one object, chosen once at start (selection.py) and carried by each step's
metadata, so that every layer of a forward asks the same object. Its jobs:
  build_metadata(step)   the tensors its attention reads for one step (input_batch.py hands it
                         the step's rows, already ordered decodes first)
  write_kv(...)          write the step's K/V into the paged cache (rotating q and k on the way)
  attend(...)            attention of the step's rows, decodes and prefill chunks
  with_visible_end(...)  the step's metadata with rows that see past their position (images)
  decode_graph_buffers   the static buffers CUDA graphs of decode steps replay with (if it has any)
and it declares which faster variants of the ops around attention it turns on (the class
attributes below), which norm.py, rotary.py, linear.py and the models read from it instead of
comparing names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from deepinfer.kv_cache import specs
from deepinfer.platforms.transfer import to_device

if TYPE_CHECKING:
    from deepinfer.kv_cache.specs import KVCacheGroup
    from deepinfer.platforms import Platform
    from deepinfer.worker.request_states import StepChunk


class AttentionLayer(Protocol):
    """What a backend reads and calls of the attention layer it serves (layers/attention/layer.py's
    Attention). A protocol here, not the class: the layer asks the backend of its step, and the
    backends must not import the layer back."""

    scale: float
    sliding_window: int | None

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor: ...

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor: ...

    def _fresh_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     end: int) -> torch.Tensor: ...

    def _fresh_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: list[tuple[int, int]],
                      out: torch.Tensor) -> None: ...


class RotaryTables(Protocol):
    """What a backend reads of a layer's rotary embedding (layers/rotary.py's RotaryEmbedding):
    its tables for the fused kernel, or the call that rotates q and k."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def flat_rows(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The flat cache row (block_id * block_size + offset) of each position of one request."""
    return block_table[positions // block_size] * block_size + positions % block_size


def sliding_window_of(group: KVCacheGroup) -> int | None:
    return specs.sliding_window_of(group.spec)


@dataclass(kw_only=True)
class GroupMetadata:
    """Where one layer group's KV lives for this step; each backend extends it with what it reads."""

    # [num_tokens] flat cache row (block_id * block_size + offset) to write each new token's K/V.
    slot_mapping: torch.Tensor


@dataclass(kw_only=True)
class AttentionMetadata:
    """One step's attention inputs, shared by every layer; each backend extends it."""

    # The backend that built this metadata: the one every layer of the forward asks.
    backend: AttentionBackend
    num_tokens: int
    # Token ranges of the decode rows (all first, contiguous) and of each prefill row.
    num_decode_tokens: int
    prefill_query_ranges: list[tuple[int, int]]
    groups: list[GroupMetadata]
    layer_to_group: list[int]
    layer_to_slot: list[int]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per slot: (K, V) as [rows, kv_heads, head_dim]
    block_size: int = 16
    # The layout it was built from, for a model that addresses its cache itself (DeepSeek-V4's
    # paged reference path reads each chunk's block tables and per-request state from it).
    step: StepLayout | None = None


@dataclass
class StepLayout:
    """One step's rows as input_batch.py lays them out: decodes (one token each) first, then the
    prefill chunks; plus what a backend needs to address the cache. Every backend builds its
    metadata from this, so the row order and the KV write rows are the same on all of them."""

    decodes: list[StepChunk]
    prefills: list[StepChunk]
    prefill_query_ranges: list[tuple[int, int]]   # each prefill chunk's token range in the step
    groups: list[KVCacheGroup]
    # Per group (in `groups` order), each chunk's block ids in row order (decodes first): the
    # only place backends learn where a request's KV lives.
    block_tables: list[list[list[int]]]
    slot_mappings: list[torch.Tensor]             # per group, on the device (GroupMetadata.slot_mapping)
    block_size: int
    layer_to_group: list[int]
    layer_to_slot: list[int]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    # The runner's choices for backends that split decode rows along the sequence (Triton:
    # fixed per batch size, so CUDA graphs stay valid) and send long fresh chunks to SDPA (None:
    # the backend's own threshold). Backends without such a choice ignore them.
    decode_splits: int = 1
    fresh_sdpa_min_tokens: int | None = None

    @property
    def ordered(self) -> list[StepChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(a), self.device)   # queued: the device may be busy

    def metadata_fields(self, backend: AttentionBackend) -> dict:
        """The AttentionMetadata fields every backend fills the same way."""
        return dict(backend=backend, num_tokens=self.num_tokens, num_decode_tokens=len(self.decodes),
                    prefill_query_ranges=self.prefill_query_ranges, layer_to_group=self.layer_to_group,
                    layer_to_slot=self.layer_to_slot, kv_caches=self.kv_caches, block_size=self.block_size,
                    step=self)


class DecodeGraphBuffers(ABC):
    """A backend's part of the CUDA graphs of decode steps (worker/cuda_graphs.py): static buffers,
    sized for the largest batch bucket, that the captured graphs read. A graph may only see
    tensors that live as long as it does, so each step's values are copied into them."""

    @abstractmethod
    def metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata of a decode step of `bucket` rows over the buffers' first rows (captured once)."""

    @abstractmethod
    def fill_for_capture(self) -> None:
        """Values to capture with: rows that read and write only the null block."""

    @abstractmethod
    def clear_after_capture(self) -> None:
        """Leave the buffers as padding rows (nothing to attend to)."""

    def accepts(self, chunks: list[StepChunk]) -> bool:
        """Whether the graphs can replay a step of these chunks (all decode rows already): the
        buffers' own limits, none by default."""
        return True

    @abstractmethod
    def load(self, meta: AttentionMetadata, bucket: int) -> None:
        """Copy a decode step's metadata (built by this backend) into the buffers' first rows and
        make the rows past its batch, up to `bucket`, harmless padding."""


class AttentionBackend(ABC):
    # The `attention_backend` value that selects this backend (selection.py reads it).
    name: ClassVar[str]

    # Faster variants of the ops around attention that this backend turns on; every layer asks
    # the backend of the forward in progress (metadata.current_backend()). All off is the plain
    # PyTorch reference path, which also runs outside any forward.
    fused_norm: ClassVar[bool] = False         # RMSNorm (+ residual add): one Triton kernel (fused/rms_norm.py)
    fused_rotary: ClassVar[bool] = False       # rotary on q and k in place, and in the attention layer
                                               # together with the K/V write: one Triton kernel (fused/rotary.py)
    fused_activation: ClassVar[bool] = False   # act(gate) * up: one Triton kernel (fused/activation.py)
    fused_gemv: ClassVar[bool] = False         # one-row projections and head: Triton GEMV (fused/gemv.py)
    fused_v4_ops: ClassVar[bool] = False       # DeepSeek-V4's mHC mixing, compressor steps and router:
                                               # Triton kernels (models/deepseek_v4/triton_*.py)
    e5m2_cache: ClassVar[bool] = True          # may hold K/V as float8 e5m2 (kv_cache/dtypes.py)
    short_cpu_norm: ClassVar[bool] = False     # RMSNorm as six eager ops (norm._rms_norm_cpu)
    short_cpu_rotary: ClassVar[bool] = False   # rotary in three eager ops, q and k rotated together
                                               # where they lie side by side (RotaryEmbedding.rotate)
    flat_cpu_layers: ClassVar[bool] = False    # plain Llama layers without module calls (llama.CpuLayerPlan)
    # Whether its kernels compile on first use, so the runner runs one step of every kind at start.
    needs_warm_up: ClassVar[bool] = False
    # Whether decode steps can replay as CUDA graphs (decode_graph_buffers).
    supports_decode_graphs: ClassVar[bool] = False
    # A model that attends itself (DeepSeek-V4) runs its own Triton kernels under this backend.
    model_kernels: ClassVar[bool] = False

    def __init__(self, device: torch.device | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        """The engine's device and KV cache dtype; None for a backend built by name to compare
        backends on hand-made inputs (selection.backend_named), which then uses its defaults."""
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype

    @classmethod
    def check_supported(cls, platform: Platform, kv_cache_dtype: torch.dtype) -> None:
        """Raise ValueError, saying what to choose instead, if this backend cannot run here."""

    def describe(self) -> str:
        """What this backend turns on, for the start-up log line."""
        fused = [name for name, on in (("norm", self.fused_norm), ("rotary + KV write", self.fused_rotary),
                                       ("activation", self.fused_activation), ("GEMV", self.fused_gemv),
                                       ("V4 mHC, compressors, router", self.fused_v4_ops)) if on]
        short = [name for name, on in (("norm", self.short_cpu_norm), ("rotary", self.short_cpu_rotary),
                                       ("flat layers", self.flat_cpu_layers)) if on]
        parts = [f"fused kernels: {', '.join(fused) or 'none'}"]
        if short:
            parts.append(f"shorter eager ops: {', '.join(short)}")
        if self.supports_decode_graphs:
            parts.append("CUDA graphs for decode steps unless enforce_eager")
        return "; ".join(parts)

    def workspace_bytes(self, groups: list[KVCacheGroup], max_model_len: int, max_num_batched_tokens: int,
                        num_heads: int) -> int:
        """Device memory a step may take beyond the step the runner profiles (a fresh chunk of
        max_num_batched_tokens), which the KV budget leaves free. 0: none."""
        return 0

    def warm_up_steps(self, max_model_len: int) -> list[list[tuple[int, int]]]:
        """The steps the runner runs eagerly at start when needs_warm_up, on a throwaway cache: each
        a list of (cached, new) tokens, one per chunk, fitting `max_model_len`. None by default."""
        return []

    def decode_splits(self, batch: int, num_kv_heads: int) -> int:
        """Sequence splits of the decode kernel for a batch of this many rows (StepLayout.decode_splits)."""
        return 1

    @abstractmethod
    def build_metadata(self, step: StepLayout) -> AttentionMetadata:
        """This step's attention inputs (host index arithmetic, copies queued to the device)."""

    def with_visible_end(self, meta: AttentionMetadata, visible_end: np.ndarray,
                         chunks: list[int]) -> AttentionMetadata | None:
        """`meta` (built by this backend) as a new metadata object whose prefill rows each see
        the keys below `visible_end` ([prefill rows] int32, positions, exclusive): a causal row's
        entry is its position + 1, a row that also sees later keys (an image's token in Gemma 3,
        multimodal/step_images.py) has a larger one. Windows and key floors still bound each
        row's keys from below. `chunks`: the prefill chunks with such rows. None: this backend
        cannot attend so (the caller names those that can)."""
        return None

    @abstractmethod
    def write_kv(self, layer: AttentionLayer, meta: AttentionMetadata, group: GroupMetadata, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, rotary: RotaryTables | None,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (with `rotary`), write k and v at the group's slots; return q and k as
        attention takes them."""

    @abstractmethod
    def attend(self, layer: AttentionLayer, meta: AttentionMetadata, group: GroupMetadata, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of every row of the step (after write_kv): [tokens, heads, head_dim]."""

    def decode_graph_buffers(self, *, num_groups: int, max_batch: int, max_blocks_per_seq: int,
                             num_kv_heads: int, block_size: int, layer_to_group: list[int],
                             layer_to_slot: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                             device: torch.device) -> DecodeGraphBuffers:
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")
