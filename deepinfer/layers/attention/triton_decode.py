"""Paged decode attention in Triton: one query token per sequence, GQA, split along the sequence.

Layout (the core's, see backends/triton.py): K and V caches are [rows, kv_heads, head_dim]
with row = block_id * block_size + offset, in q's dtype or in fp8 (kv_cache/dtypes.py);
`block_table[b, i]` is the i-th block of sequence b; `seq_lens[b]` counts the KV positions
including this step's token (already written).

One program per (sequence, KV head, split). The program loads the G query heads that share its
KV head as one [G, D] tile, so each K/V element is read once for the whole group, and streams
its share of the sequence with an online softmax. Splitting the sequence keeps the GPU's
multiprocessors busy when the batch is small (batch 1 has only `kv_heads` programs otherwise);
a second kernel merges the splits by their log-sum-exp. A batch large enough for one split
(e.g. 512 rows) skips the merge: the split kernel writes the output itself. A sliding window
just moves the start.

An fp8 cache (kv_cache/dtypes.py) is converted in registers, and the products run in float16
for a 16-bit q: e4m3 values are exact in float16, and the hardware converts e4m3 to float16 in one
instruction where bfloat16 needs three. float16 also carries more mantissa than bfloat16 for q and
the probabilities; q is clamped to float16's range first. Where it applies (head_dim 128, at most
8 query heads per KV head) the CUDA C++ kernel of cuda_decode.py takes an fp8 cache instead:
this one stays well above the bandwidth bound there, that one comes close to copy bandwidth
(docs/benchmarks/design-measurements.md#cuda-fp8-decode-kernel).

The split count is a host-side choice that does not depend on the lengths, so a CUDA graph
captured for a batch size stays valid whatever the sequences' lengths are at replay. It is a
runtime argument, not a compile-time constant, and so are the arguments that change from step to
step (the block table's width, the offsets of the metadata tensors): Triton compiles a kernel per
distinct set of compile-time values, and a compile takes many times a step, so each new value
met while serving would stall a step for that long (the first run of gpu_fast_path.py's (c) lost
seconds to compiles of identical kernels: docs/benchmarks/design-measurements.md#triton-compile-stalls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.kv_cache.dtypes import is_fp8
from deepinfer.layers.attention import cuda_decode
from deepinfer.layers.fused import pdl_enabled, pdl_launch

MAX_SPLITS = 32


# Values that change from step to step (the split count sets the partial outputs' strides): no
# compile-time specialization on them (module docstring).
SPLIT_ARGS = ["num_splits", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]


@triton.jit(do_not_specialize=["stride_bt", *SPLIT_ARGS],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, o_part_ptr, lse_part_ptr, out_ptr,
    scale,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, WINDOW: tl.constexpr,
    IEEE: tl.constexpr, DOT_F16: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOW > 0:   # a constexpr: one compiled kernel per window size, no runtime branch
        lo = tl.maximum(seq_len - WINDOW, 0)
    # Each split takes a whole number of BLOCK_N tiles of [lo, seq_len).
    tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_F16:   # an fp8 cache under a 16-bit q: products in float16 (module docstring)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(block_table_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        rows = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        # An fp8 cache is converted in registers: the bytes read are halved.
        k = tl.load(k_cache_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + dims[None, :],
                    mask=pos_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)
        if IEEE:   # float32 models: exact products, not TF32 (parity tests run in float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                    mask=pos_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)
        if DOT_F16:
            # The product by the row mask changes no value (masked rows loaded as 0). It is there
            # for the compiler: with an op between the conversion and the dot, V is converted
            # before it is staged in shared memory, and the dot reads 16-bit V with transposing
            # matrix loads, not fp8 bytes one at a time, and the kernel runs markedly faster
            # (docs/benchmarks/design-measurements.md#fp8-decode-v-conversion).
            v = v * pos_ok.to(v.dtype)[:, None]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty split (short sequence, or a padded row with seq_len 0) reports lse = -inf.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:   # the whole sequence in this program: the result is final, no merge
        tl.store(out_ptr + seq * stride_outb + heads[:, None] * stride_outh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
        return
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_part_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :],
             out, mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(lse_part_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit(do_not_specialize=SPLIT_ARGS)
def _merge_splits_kernel(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, num_splits,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < num_splits
    lse = tl.load(lse_part_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)                                  # 0 for empty splits
    total = tl.sum(w, 0)
    o = tl.load(o_part_ptr + seq * stride_ob + head * stride_oh + splits[:, None] * stride_os + dims[None, :],
                mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_outb + head * stride_outh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def num_splits_for(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Enough splits to give every multiprocessor about two programs, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, batch * num_kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None, block_size: int, num_splits: int,
                           out: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]. `window` None or 0: full attention.

    `kernel`: "auto" takes the CUDA C++ kernel of cuda_decode.py where it applies (an fp8 cache
    under a 16-bit q), this module's Triton kernel otherwise; "triton" always this one (tests and
    benchmarks compare the two)."""
    if kernel not in ("auto", "triton"):
        raise ValueError(f"kernel must be 'auto' or 'triton', got {kernel!r}")
    batch, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    # With one split the kernel writes `out` itself and never touches these.
    o_part = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if kernel == "auto" and cuda_decode.supported(q, k_cache, v_cache, out):
        cuda_decode.decode_fp8(q, k_cache, v_cache, block_table, seq_lens, scale, window, block_size,
                               num_splits, out, o_part, lse_part)
    else:
        _launch_split_kernel(q, k_cache, v_cache, block_table, seq_lens, scale, window, block_size,
                             num_splits, out, o_part, lse_part)
    if num_splits == 1:
        return out
    _merge_splits_kernel[(batch, num_heads)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), SPLITS_PAD=MAX_SPLITS, num_warps=4,
        USE_PDL=pdl_enabled(), **pdl_launch(),
    )
    return out


def _launch_split_kernel(q, k_cache, v_cache, block_table, seq_lens, scale, window, block_size, num_splits,
                         out, o_part, lse_part) -> None:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    fp8 = is_fp8(k_cache.dtype)
    # An fp8 cache moves half the bytes per key: twice the keys per tile. For fp8, 128 keys and 2
    # stages were timed faster than 64 keys, 3 or 4 stages, or a register cap for more blocks per
    # SM; bf16 keeps 64 keys and 2 stages. The shape and card:
    # docs/benchmarks/design-measurements.md#fp8-decode-tile
    block_n = (128 if fp8 else 64) if dim_pad <= 128 else 32
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, out,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1, WINDOW=window or 0,
        IEEE=q.dtype == torch.float32, DOT_F16=fp8 and q.dtype != torch.float32, num_warps=4, num_stages=2,
        USE_PDL=pdl_enabled(),
        **pdl_launch(),
    )
