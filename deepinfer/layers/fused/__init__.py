"""Fused Triton kernels for the CUDA fast path: fewer, larger kernels per decoder layer.

Why: a decode step reads each weight once and does little arithmetic, so at small batches a
layer's time is spent launching kernels, not computing. The plain PyTorch ops launch several
kernels each (a bf16 RMSNorm is upcast, square, mean, rsqrt, multiply, multiply, downcast; rotary
is a cat, a neg and four multiplies per tensor; the KV write is two index_copy_ calls), and even
inside a CUDA graph every kernel costs its own launch latency and its own trip through memory.
Each kernel here does one of those groups in one pass over the data:

  rms_norm.py    RMSNorm, optionally fused with the residual add before it
                 (`residual += x; out = rms_norm(residual) * w`), Llama and Gemma (1 + w) weights
  activation.py  SiLU(gate) * up (or GELU-tanh for Gemma) straight from the fused gate_up output
  rotary.py      rotary embedding applied in place to q and k, in one kernel for both
  kv_write.py    K and V of this step written into the paged caches at their slots

The plain PyTorch code in norm.py, rotary.py, models/llama.py and attention/layer.py stays the
reference path (CPU, and the CUDA reference backend that parity tests use); these kernels run
only inside a forward whose attention backend is "triton" (`enabled()`), and tests compare the
two (tests/unit/test_fused_kernels.py).

Every kernel is CUDA-graph safe: shapes and launch grids depend only on tensor shapes, never on
values, and nothing is read back to the host. Triton is not installed on CPU machines, so the
kernel modules are imported inside the functions that call them, never at import time here.
"""

from __future__ import annotations

from deepinfer.layers.attention.metadata import current_backend


def enabled() -> bool:
    """True inside a forward on the fast path (attention backend "triton")."""
    return current_backend() == "triton"
