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
  rotary.py      rotary embedding applied in place to q and k, in one kernel for both; the
                 attention layer's variant also writes K and V into the paged caches
  kv_write.py    K and V of this step written into the paged caches at their slots (for layers
                 without rotary)
  gemv.py        the projections of a one-row decode step (weight-streaming matrix-vector)

Programmatic dependent launch (PDL, Hopper and later): in a decode step each kernel is short, and
the GPU would sit idle between one kernel's last block and the next kernel's first. Launched with
PDL, the next kernel's blocks start while the previous kernel finishes: each program first does
what needs nothing from earlier kernels (gemv loads its first strip of weights), then waits at
`gdc_wait()` until every earlier kernel has finished and its writes are visible, and only then
reads activations or writes anything. Every PDL kernel calls `gdc_wait()` in every program,
before its first write, so the chain of waits orders each kernel after all earlier ones (a
kernel that skipped it could finish before its predecessor). `gdc_launch_dependents()` right
after the wait lets the next kernel launch once all of this kernel's programs have started.
Kernels launched without PDL (cuBLAS, PyTorch ops) wait for everything before them as usual.

The plain PyTorch code in norm.py, rotary.py, linear.py, models/ and the reference attention
backend stays the reference path (CPU, and the CUDA reference backend that parity tests use);
these kernels run only inside a forward whose attention backend turns them on, each by its own
flag (AttentionBackend.fused_norm, fused_rotary, fused_activation, fused_gemv in
layers/attention/backends/base.py; the Triton backend turns on all four), and tests compare the
two (tests/unit/test_fused_kernels.py).

Every kernel is CUDA-graph safe: shapes and launch grids depend only on tensor shapes, never on
values, and nothing is read back to the host. Triton is not installed on CPU machines, so the
kernel modules are imported inside the functions that call them, never at import time here.
"""

from __future__ import annotations

import functools

import torch

from deepinfer import envs


@functools.cache
def pdl_enabled() -> bool:
    """Whether the kernels launch with PDL: a Hopper-or-later GPU, not Triton's interpreter
    (it cannot run the wait instruction), and DEEPINFER_PDL not 0."""
    return (envs.pdl() and not envs.triton_interpreter() and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def pdl_launch() -> dict:
    """Launch options for a PDL kernel: `kernel[grid](..., USE_PDL=pdl_enabled(), **pdl_launch())`."""
    return {"launch_pdl": True} if pdl_enabled() else {}
