"""The gated MLP's activation in one Triton kernel: act(gate) * up from the fused gate_up output.

The MLP's first matmul writes [gate | up] side by side (FusedLinear, see models/base.py). The
reference path chunks that into two views, applies the activation (a kernel, plus casts), and
multiplies (another kernel), reading and writing the intermediate in between. Here one program
reads a slice of gate and the matching slice of up from the same row and writes the product:
each element is read once and the [tokens, intermediate] result written once.

The activation is computed in float32 and the product rounded once, where the reference rounds
act(gate) to the activation dtype before multiplying: identical in float32, within one rounding
in bf16.

Activations: "silu" (Llama, Mistral, Qwen) and "gelu_pytorch_tanh" (Gemma 3), the two that
GatedMLP supports; `gated_act` takes gate and up as two tensors, and a `limit` clamps them first
as DeepSeek-V4's SwiGLU does (gate at most limit, up within +-limit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
BLOCK = 1024   # columns per program: 8 bf16 (one 16-byte load) per thread at 4 warps


@triton.jit
def _act_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, stride_out, limit,
                        GELU_TANH: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if GELU_TANH:
        # GELU's tanh form 0.5 * g * (1 + tanh(u)), u = sqrt(2/pi) * (g + 0.044715 g^3), equals
        # g * sigmoid(2u) exactly (1 + tanh(u) = 2 sigmoid(2u)): no tanh needed, no cancellation.
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * u)
    else:
        act = gate * tl.sigmoid(gate)   # SiLU
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate_up[..., :n]) * gate_up[..., n:] for gate_up [..., 2n] -> a new [..., n] tensor."""
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return gated_act(x[:, :n], x[:, n:], act).view(*gate_up.shape[:-1], n)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", limit: float | None = None) -> torch.Tensor:
    """act(gate) * up for gate, up [..., n] (each row's columns contiguous) -> a new tensor; with
    `limit`, gate clamped to at most limit and up to [-limit, limit] first."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported")
    n = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, n), up.reshape(-1, n)
    gate2 = gate2 if gate2.stride(-1) == 1 else gate2.contiguous()
    up2 = up2 if up2.stride(-1) == 1 else up2.contiguous()
    out = torch.empty(gate2.shape[0], n, dtype=gate.dtype, device=gate.device)
    if gate2.shape[0] and n:
        _act_and_mul_kernel[(gate2.shape[0], triton.cdiv(n, BLOCK))](
            gate2, up2, out, n, gate2.stride(0), up2.stride(0), out.stride(0), float(limit or 0.0),
            GELU_TANH=act == "gelu_pytorch_tanh", CLAMP=bool(limit), BLOCK=BLOCK, num_warps=4,
            USE_PDL=pdl_enabled(), **pdl_launch(),
        )
    return out.view(*gate.shape[:-1], n)
