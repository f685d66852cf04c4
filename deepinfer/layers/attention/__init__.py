"""Attention over the paged KV cache.

Model files call `Attention(...)(q, k, v)` and never see batching details: the runner sets the
step's `AttentionMetadata` around the forward (see `forward_context`). Backends: `reference`
(plain PyTorch, CPU and CUDA; what parity tests use) and `triton` (CUDA only: the paged kernels
in triton_decode.py and triton_prefill.py, compared against the reference in tests).
"""

from deepinfer.layers.attention.layer import Attention
from deepinfer.layers.attention.metadata import AttentionMetadata, forward_context, get_forward_context

__all__ = ["Attention", "AttentionMetadata", "forward_context", "get_forward_context"]
