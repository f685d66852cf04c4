"""Matrix-vector products for decode steps of a few rows: y = x @ W.T (+ bias), in Triton.

Why: at batch 1 a decode step is a stream of weight reads, and the time of the step is set by
how close those reads come to the card's memory bandwidth. cuBLAS picks a GEMM-shaped kernel for
one row that, on the H200, reads Llama-3-8B's projections at ~3.8 TB/s against the 4.2 TB/s a
plain copy achieves. This kernel is shaped for the job instead: each program owns BLOCK_N output
columns (rows of W, contiguous along K) and walks K in long BLOCK_K strips, so every thread
issues several 16-byte loads at once, the next strip is loaded while the current one is
multiplied, and enough programs sit on each multiprocessor to keep the memory system full. With
PDL (fused/__init__.py) the first strip is in flight before the previous kernel has finished. The few x rows (at most MAX_ROWS) are re-read from L2 by every program,
which is cheap beside W. Products accumulate in float32 elementwise and are reduced once at
the end; the result is rounded once to x's dtype, as cuBLAS does.

The tile sizes come from a table measured on the H200 per (N, K) (benchmarks/decode_gemv.py);
shapes outside it take a default that measured within a few per cent of the best everywhere.
Nothing depends on values, so the kernel is CUDA-graph safe.

The reference is F.linear; tests/unit/test_gemv.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch

MAX_ROWS = 4   # above this, cuBLAS's tensor-core kernels are the better tool


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    N, K, stride_xm, stride_wn, stride_om,
    M: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols_n < N
    ks = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + ms[:, None] * stride_xm + ks[None, :]
    # W is read once per step: stream it past the cache (evict_first); x is shared by every
    # program (evict_last). The first strip of W needs nothing from earlier kernels, so it is
    # in flight before the wait for them (see fused/__init__.py on PDL).
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (ks[None, :] < K), other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=m_ok[:, None] & (k + ks[None, :] < K), other=0.0,
                    eviction_policy="evict_last")
        # The next strip is loaded before this one is used: two strips in flight per program.
        w_next = tl.load(w_ptrs + k + BLOCK_K, mask=n_ok[:, None] & (k + BLOCK_K + ks[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    y = tl.sum(acc, axis=2)                                    # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + ms[:, None] * stride_om + cols_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps) at one row, measured on the H200 (decode_gemv.py).
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (8, 512, 4), (4096, 4096): (4, 512, 4), (28672, 4096): (4, 1024, 4),
    (4096, 14336): (4, 2048, 4), (128256, 4096): (4, 1024, 4),   # Llama-3-8B
}
DEFAULT_CONFIG = (4, 1024, 4)


def gemv_config(n: int, k: int, rows: int) -> tuple[int, int, int]:
    """Tile sizes for an [rows, k] x [n, k].T product. More rows hold more accumulators per
    thread, so the K strip shrinks as rows grow (the register file holds M_PAD * BLOCK_N *
    BLOCK_K floats per program)."""
    block_n, block_k, warps = TUNED.get((n, k), DEFAULT_CONFIG)
    m_pad = triton.next_power_of_2(rows)
    block_k = max(128, block_k // m_pad)
    while block_k > 128 and block_k > triton.next_power_of_2(k):
        block_k //= 2
    return block_n, block_k, warps


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight [N, K].T (+ bias [N]) -> [M, N]
    in x's dtype. `config` (BLOCK_N, BLOCK_K, num_warps) overrides the table (benchmarks)."""
    rows, k = x.shape
    n = weight.shape[0]
    if not 0 < rows <= MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of x [M, K] against weight [N, K]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    block_n, block_k, warps = config or gemv_config(n, k, rows)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        n, k, x.stride(0), weight.stride(0), out.stride(0),
        M=rows, M_PAD=triton.next_power_of_2(rows), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl_enabled(), num_warps=warps, **pdl_launch(),
    )
    return out
