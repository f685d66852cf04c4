"""Matrix-vector products for one-row decode steps: y = x @ W.T (+ bias), in Triton.

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

FP8 weights (layers/quantization/fp8.py) are read as they are stored, a byte a weight: with one
scale per output channel (`quantization="fp8"`) the row sums are scaled once at the end; with
128 x 128 block scales (DeepSeek-V4's format) a program's rows share their block row, so the
scales multiply the strip of x instead of every weight. The activations stay in their dtype (no
FP8 rounding of x), so the product is the dequantized weight's, as the reference path computes it.

The reference is F.linear (on the dequantized weight for FP8); tests/unit/test_gemv.py compares
the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_wn, stride_sn, rows_per_group, stride_xg,
    HAS_BIAS: tl.constexpr, SCALES: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # SCALES: 0 none, 1 one per output channel (applied to the row sums), 2 one per SCALE_BLOCK x
    # SCALE_BLOCK block: BLOCK_N divides SCALE_BLOCK, so a program's rows share their block row
    # and the scales vary along K only; they multiply x (BLOCK_K values a strip), not W.
    scale_row = scale_ptr + (tl.program_id(0) * BLOCK_N // SCALE_BLOCK) * stride_sn
    # Grouped (block-diagonal) weights: a program's rows all belong to one group, whose own row
    # of x they multiply (rows_per_group = N and group 0 for a plain product).
    x_ptr += (tl.program_id(0) * BLOCK_N // rows_per_group) * stride_xg
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols_n < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # W is read once per step: stream it past the cache (evict_first); x is read by every
    # program (evict_last). The first strip of W needs nothing from earlier kernels, so it is
    # loaded before the wait for them (fused/__init__.py on PDL).
    if EVEN_N and EVEN_K:   # constexprs: the unmasked loads compile to 16-byte vector loads
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & (ks[None, :] < K), other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if EVEN_K:
        x = tl.load(x_ptr + ks, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0, eviction_policy="evict_last")
    x = x.to(tl.float32)
    if SCALES == 2:
        x *= tl.load(scale_row + ks // SCALE_BLOCK, mask=ks < K, other=0.0)
    acc = x[None, :] * w.to(tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k, mask=n_ok[:, None] & (k + ks[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptr + k + ks, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr + k + ks, mask=k + ks < K, other=0.0, eviction_policy="evict_last")
        x = x.to(tl.float32)
        if SCALES == 2:
            x *= tl.load(scale_row + (k + ks) // SCALE_BLOCK, mask=k + ks < K, other=0.0)
        acc += x[None, :] * w.to(tl.float32)
    y = tl.sum(acc, axis=1)
    if SCALES == 1:
        y *= tl.load(scale_ptr + cols_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps): the fastest configs of a search with PDL launches,
# each call following another as in a decode step (scratch runs of benchmarks/decode_gemv.py's
# --tune); the card they were searched on, and when the table should be searched again:
# docs/benchmarks/design-measurements.md#gemv-tuning-table
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (28672, 4096): (4, 1024, 4), (128256, 4096): (4, 1024, 4),   # Llama-3-8B gate_up, head
}
DEFAULT_CONFIG = (4, 2048, 4)   # Llama-3-8B qkv, o and down searched best with this (same search)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """Tile sizes for a [1, k] x [n, k].T product: the table's, else the default, with the K
    strip no longer than K needs."""
    block_n, block_k, warps = TUNED.get((n, k), DEFAULT_CONFIG)
    return block_n, min(block_k, max(16, triton.next_power_of_2(k))), warps


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None, scale: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, groups: int = 1) -> torch.Tensor:
    """x [1, K] @ weight [N, K].T (+ bias [N]) -> [1, N] in x's dtype. `config` (BLOCK_N,
    BLOCK_K, num_warps) overrides the table (benchmarks, tests). FP8 weights come with their
    float32 `scale`: [N] per channel, or [ceil(N / b), ceil(K / b)] with block (b, b).

    groups > 1: a block-diagonal weight (DeepSeek-V4's grouped output projection). x is
    [groups, K], a row per group, and group g's N / groups rows of the weight multiply x[g]
    only; the result is still [1, N], the groups' outputs side by side."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (groups, k) or n % groups:
        raise ValueError(f"gemv takes one row x [1, K] (a row per group: [groups, K], groups dividing N) "
                         f"against weight [N, K]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"groups {groups}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    if block is not None and (block[0] != block[1] or scale is None or scale.dim() != 2):
        raise ValueError(f"gemv takes square scale blocks with a 2D scale, not {block}")
    block_n, block_k, warps = config or gemv_config(n, k)
    if block is not None and block[0] % block_n:
        raise ValueError(f"gemv's {block_n} rows a program must divide the scale block {block[0]}")
    if groups > 1 and (n // groups) % block_n:
        raise ValueError(f"gemv's {block_n} rows a program must divide a group's {n // groups} rows")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    scales = 0 if scale is None else (2 if block is not None else 1)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else weight, bias if bias is not None else weight, out, n, k,
        weight.stride(0), scale.stride(0) if scales == 2 else 0, n // groups, x.stride(0),
        HAS_BIAS=bias is not None, SCALES=scales, SCALE_BLOCK=block[0] if block else 1,
        BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, USE_PDL=pdl_enabled(), num_warps=warps, **pdl_launch(),
    )
    return out
