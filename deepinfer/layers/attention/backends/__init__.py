"""Attention backends: one object, chosen once at start, that every layer of a forward asks.

  base.py       the interface (AttentionBackend), the metadata types every backend extends, the
                step layout they are built from, and the CUDA-graph buffers' interface
  reference.py  plain PyTorch on any device: what the fast paths are tested against
  cpu.py        the CPU default: the reference with a batched head-major decode and shorter ops
  triton.py     the CUDA fast path: paged Triton kernels (and the CUDA C++ fp8 decode kernel),
                every fused kernel of layers/fused/, CUDA graphs for decode steps
  selection.py  `attention_backend` (a name in the config) -> the backend object, the one place
                that reads a name; "auto" is the platform's choice
"""

from deepinfer.layers.attention.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGraphBuffers,
    GroupMetadata,
    StepLayout,
)
from deepinfer.layers.attention.backends.selection import backend_named, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGraphBuffers", "GroupMetadata", "StepLayout",
           "backend_named", "select_backend"]
