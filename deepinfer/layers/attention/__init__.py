"""Attention over the paged KV cache.

Model files call `Attention(...)(q, k, v)` and never see batching details: the runner sets the
step's metadata around the forward (see `forward_context`), and the backend that built it
(backends/: `reference`, `cpu`, `triton`, one object chosen once at start) writes the K/V and
attends. Backends: `reference` (plain PyTorch, CPU and CUDA; what the fast paths are checked
against), `triton` (CUDA only: the paged kernels in triton_decode.py and triton_prefill.py, the
CUDA C++ fp8 decode kernel in cuda_decode.py, compared against the reference in tests) and `cpu`
(the CPU default: decode rows batched in one gather and two matmuls, cpu_decode.py; prefill rows
as in the reference).
"""

from deepinfer.layers.attention.backends.base import AttentionMetadata
from deepinfer.layers.attention.layer import Attention
from deepinfer.layers.attention.metadata import forward_context, get_forward_context

__all__ = ["Attention", "AttentionMetadata", "forward_context", "get_forward_context"]
