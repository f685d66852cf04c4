"""Products of a few rows against a big weight: y = x @ W.T (+ bias) for 2-16 rows, in Triton.

Why: a step of a few decode rows (batch 2-16, or a batch-1 verify step of 1 + k rows in
speculative decoding) reads each weight once, like a one-row step, and should cost about the
same. cuBLAS picks skinny-GEMM kernels for it that read the weights well below copy bandwidth
(a batch-1 verify step of 6 rows on the 8B shape took ~0.7 ms more than a one-row step, H200),
and the one-row GEMV (gemv.py) multiplies on CUDA cores, which at 6 rows costs more than the
reads. This kernel streams W like the GEMV (each program owns BLOCK_N output columns and walks
K in BLOCK_K strips, Triton pipelining the loads num_stages deep) and multiplies on tensor cores:
the rows are padded to 16 (tl.dot's smallest M), which costs nothing but registers since the
step is bound by W's reads. With PDL (fused/__init__.py) a program loads its first strip of W
before waiting for the previous kernel.

Not wired into the model (layers/linear.py keeps cuBLAS for more than one row): measured on the
H200, a whole step's matmuls at 6 rows ran 6 % faster back to back (benchmarks/decode_gemv.py
--rows), but with the searched tiles in the model a batch-1 verify chain ran 5 % slower and a
batch-16 decode 2.6 % slower, likely because the search times calls back to back under PDL,
which hides the few programs (96-128 on 132 SMs) its best tiles launch. The kernel, its tests
and the search stay for a search that times tiles inside a real step. Figures:
docs/benchmarks/design-measurements.md#few-rows-gemm
Products accumulate in float32 and are rounded once to x's dtype. Nothing depends on values, so
the kernel is CUDA-graph safe. The reference is F.linear; tests/unit/test_few_rows.py compares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch

MAX_ROWS = 16   # tl.dot's smallest M: more rows would need a second row tile


@triton.jit
def _few_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr,
):
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols_n < N
    rows = tl.arange(0, ROWS)
    m_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    if USE_PDL:   # x comes from the kernel before: wait for it (and let the next one launch)
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k, mask=n_ok[:, None] & (k + ks[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptrs + k, mask=m_ok[:, None] & (k + ks[None, :] < K), other=0.0,
                        eviction_policy="evict_last")
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages) for 2-16 rows: what
# benchmarks/decode_gemv.py --rows found on the H200 for Llama-3-8B (the shapes where it beat
# cuBLAS at every row count, timed back to back). The benchmark's defaults; not used by the model.
FEW_ROWS_TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (64, 128, 4, 5), (4096, 4096): (32, 256, 4, 5), (4096, 14336): (32, 256, 4, 5),
    (128256, 4096): (64, 128, 4, 4)}


def few_rows_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """The searched configuration of an [M, k] x [n, k].T product, or None (cuBLAS then)."""
    return FEW_ROWS_TUNED.get((n, k))


def few_rows_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (2 <= M <= 16) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype. `config`
    (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the table (benchmarks, tests)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"few_rows_matmul takes x [M, K] with 1 <= M <= {MAX_ROWS} against weight [N, K]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    config = config or few_rows_config(n, k)
    if config is None:
        raise ValueError(f"no few-rows configuration for N={n}, K={k} (FEW_ROWS_TUNED)")
    block_n, block_k, warps, stages = config
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, ROWS=MAX_ROWS,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, USE_PDL=pdl_enabled(), STAGES=stages,
        num_warps=warps, **pdl_launch(),
    )
    return out
