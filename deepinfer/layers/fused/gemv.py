"""Matrix-vector products for one-row decode steps: y = x @ W.T (+ bias), in Triton, optionally
with the RMSNorm before the product and the gated activation after it in the same kernel.

Why: at batch 1 a decode step is a stream of weight reads, and the step takes as long as those
reads. In a Llama-3-8B step cuBLAS reads the projections below copy bandwidth, and furthest below
it on the small o and qkv matrices, whose kernels are too short to reach full speed (o and down
also launch a split-K reduction). This kernel is shaped for the job: each program
owns BLOCK_N output columns (rows of W, contiguous along K) and walks K in long BLOCK_K strips,
so every thread has several 16-byte loads in flight and enough programs sit on each
multiprocessor to keep the memory system busy. With PDL (fused/__init__.py) a program loads
its first strip before waiting for the previous kernel to finish, so the next matrix is already
streaming while the last kernel drains. Measured one call after another with PDL, as in a step
(benchmarks/decode_gemv.py), it is faster than cuBLAS on each of the five matrices, and a whole
step's products reach the copy bandwidth measured in the same run. Figures:
docs/benchmarks/design-measurements.md#gemv-one-row

x is re-read from L2 by every program, which is cheap beside W. Products accumulate in float32
elementwise and are reduced once at the end; the result is rounded once to x's dtype. Nothing
depends on values, so the kernel is CUDA-graph safe.

Fusions (`norm_gemv`, `gemv(..., act=)`; off by default until they have run on a GPU:
AttentionBackend.gemv_fusions): what remains of a one-row step besides the weight
reads is a chain of tiny kernels, each costing a few microseconds of latency whatever its size.
Two of a Llama layer's are folded into its GEMVs:
- the residual add + RMSNorm before qkv and gate_up. RMSNorm scales the whole row by one number,
  rsqrt(mean(r^2) + eps), so a program need not know it before the product: it multiplies W by
  r * norm_weight strip by strip, sums r^2 on the way, and scales its outputs at the end. Every
  program reads r's strips (from L2, as it reads x) and program 0 writes the new residual stream.
  The reference rounds the normalised row to x's dtype before the product; here it stays float32
  (one rounding less, within the tolerance the tests use).
- act(gate) * up after gate_up. A program owns BLOCK_N columns of gate and the same columns of up
  (W's rows j and N + j), and writes act(gate) * up, both rounded to x's dtype first as the
  reference's act_and_mul reads them.

The reference is F.linear (and rms_norm, act_and_mul); tests/unit/test_gemv.py compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch

ACTIVATIONS = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}


@triton.jit
def _load_w(w_ptrs, k, ks, n_ok, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] strip of W at column k, streamed past the cache (read once a step)."""
    if EVEN_N and EVEN_K:   # constexprs: the unmasked loads compile to 16-byte vector loads
        return tl.load(w_ptrs + k, eviction_policy="evict_first").to(tl.float32)
    return tl.load(w_ptrs + k, mask=n_ok[:, None] & (k + ks[None, :] < K), other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _load_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, k, ks, K, norm_offset, write_residual,
            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation strip at column k, float32, read by every program (kept in L2: evict_last).
    With NORM: r = x (+ residual, rounded to x's dtype as the reference adds), returned as
    r * norm weight with r itself for the sum of squares; the program that `write_residual`s
    stores r as the new residual stream."""
    mask = k + ks < K
    if EVEN_K:
        x = tl.load(x_ptr + k + ks, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + k + ks, mask=mask, other=0.0, eviction_policy="evict_last")
    if not NORM:
        return x.to(tl.float32), x.to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + k + ks, mask=mask, other=0.0, eviction_policy="evict_last")
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + k + ks, x, mask=mask & write_residual)
    r = x.to(tl.float32)
    g = tl.load(norm_w_ptr + k + ks, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return r * (g + norm_offset), r


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, norm_w_ptr, res_out_ptr,
    N, K, stride_wn, up_offset, eps, norm_offset,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols_n < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    up_ptrs = w_ptrs + up_offset   # with ACT: up's rows follow gate's N rows (N * stride_wn on)
    write_residual = pid == 0
    # The first strip of W needs nothing from earlier kernels, so it is loaded before the wait
    # for them (fused/__init__.py on PDL).
    w = _load_w(w_ptrs, 0, ks, n_ok, K, EVEN_N, EVEN_K)
    if ACT:
        w_up = _load_w(up_ptrs, 0, ks, n_ok, K, EVEN_N, EVEN_K)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    xw, r = _load_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, 0, ks, K, norm_offset, write_residual,
                    NORM, HAS_RESIDUAL, EVEN_K)
    acc = xw[None, :] * w
    if ACT:
        acc_up = xw[None, :] * w_up
    if NORM:
        squares = r * r
    for k in range(BLOCK_K, K, BLOCK_K):
        w = _load_w(w_ptrs, k, ks, n_ok, K, EVEN_N, EVEN_K)
        if ACT:
            w_up = _load_w(up_ptrs, k, ks, n_ok, K, EVEN_N, EVEN_K)
        xw, r = _load_x(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, k, ks, K, norm_offset, write_residual,
                        NORM, HAS_RESIDUAL, EVEN_K)
        acc += xw[None, :] * w
        if ACT:
            acc_up += xw[None, :] * w_up
        if NORM:
            squares += r * r
    y = tl.sum(acc, axis=1)
    if ACT:
        y_up = tl.sum(acc_up, axis=1)
    if NORM:   # the norm's one scale per row, applied after the product (module docstring)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        y = y * rstd
        if ACT:
            y_up = y_up * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)
        if ACT:
            y_up += tl.load(bias_ptr + N + cols_n, mask=n_ok, other=0.0).to(tl.float32)
    if ACT:
        # gate and up rounded as the reference's gate_up output is, then act(gate) * up in float32
        # (fused/activation.py: GELU-tanh as g * sigmoid(2u)).
        gate = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = y_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        if ACT == 2:
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            y = gate * tl.sigmoid(2.0 * u) * up
        else:
            y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + cols_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps): the fastest configs of a search with PDL launches,
# each call following another as in a decode step (scratch runs of benchmarks/decode_gemv.py's
# --tune); the card they were searched on, and when the table should be searched again:
# docs/benchmarks/design-measurements.md#gemv-tuning-table
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (28672, 4096): (4, 1024, 4), (128256, 4096): (4, 1024, 4),   # Llama-3-8B gate_up, head
}
DEFAULT_CONFIG = (4, 2048, 4)   # Llama-3-8B qkv, o and down searched best with this (same search)


def gemv_config(n: int, k: int, act: str | None = None) -> tuple[int, int, int]:
    """Tile sizes for a [1, k] x [n, k].T product: the table's, else the default, with the K
    strip no longer than K needs. With `act` a program reads two rows per output column, so it
    owns half the columns of the plain product's tile."""
    block_n, block_k, warps = TUNED.get((n, k), DEFAULT_CONFIG)
    if act is not None:
        block_n = max(1, block_n // 2)
    return block_n, min(block_k, max(16, triton.next_power_of_2(k))), warps


def _check(x: torch.Tensor, weight: torch.Tensor, act: str | None) -> None:
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k):
        raise ValueError(f"gemv takes one row x [1, K] against weight [N, K]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported (one of {list(ACTIVATIONS)})")
    if act is not None and n % 2:
        raise ValueError(f"a gated product needs an even number of weight rows [gate; up], got {n}")


def _launch(x, weight, bias, act, config, norm=None) -> torch.Tensor:
    n, k = weight.shape
    n_out = n // 2 if act is not None else n
    block_n, block_k, warps = config or gemv_config(n, k, act)
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    residual, norm_weight, residual_out, eps, offset = norm or (None, None, None, 0.0, 0.0)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        residual_out if residual_out is not None else out,
        n_out, k, weight.stride(0), n_out * weight.stride(0), eps, offset,
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        ACT=ACTIVATIONS[act], BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=n_out % block_n == 0, EVEN_K=k % block_k == 0, USE_PDL=pdl_enabled(), num_warps=warps,
        **pdl_launch(),
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None, act: str | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K].T (+ bias [N]) -> [1, N] in x's dtype. With `act` ("silu",
    "gelu_pytorch_tanh") weight is [gate; up] and the result act(gate) * up, [1, N / 2].
    `config` (BLOCK_N, BLOCK_K, num_warps) overrides the table (benchmarks, tests)."""
    _check(x, weight, act)
    return _launch(x, weight, bias, act, config)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None,
              norm_offset: float = 0.0, config: tuple[int, int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv(rms_norm(residual + x) * (norm_weight + norm_offset), weight, bias, act=act) in one
    kernel, and the new residual stream residual + x (a new tensor: the programs still read the
    old one while program 0 writes). Without a residual (the first layer) the row is x itself,
    returned as the residual stream as the reference does."""
    _check(x, weight, act)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype} and be contiguous")
    residual_out = torch.empty_like(x) if residual is not None else None
    out = _launch(x, weight, bias, act, config, (residual, norm_weight, residual_out, eps, norm_offset))
    return out, residual_out if residual is not None else x
