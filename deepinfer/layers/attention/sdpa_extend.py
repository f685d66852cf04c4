"""A long prefill chunk on a long cached prefix, through SDPA's fused kernel (cuDNN on the GPU).

The paged prefill kernel (triton_prefill.py) runs a long chunk on a long cached prefix well
below cuDNN's fused kernel's rate: measured on the GPU, this path takes markedly less device time
than the paged kernel from 4k queries on 4k keys to 16k on 115k, and it shortens a whole 128k
prompt's prefill (docs/benchmarks/design-measurements.md#sdpa-extend). cuDNN, as torch calls it,
reads no block tables and aligns its causal mask top-left (query i sees keys 0..i), so a chunk
of C queries at positions [P, P + C) is attended in two parts, each with its log-sum-exp, and the
parts are merged as the softmax over the union of their keys:

    prefix     keys [0, S)       every query sees every key: no mask
    diagonal   keys [S, P + C)   causal, made square by leading zero queries for positions [S, P)

S is P rounded down to a multiple of PREFIX_BUCKET, so the leading queries are fewer than
PREFIX_BUCKET (their outputs are dropped; a zero query sees a uniform softmax, no NaN). Both
parts' query and key counts are rounded up to LENGTH_BUCKET with rows after the chunk: under the
causal mask no real query sees those keys, and in the prefix part the extra queries are dropped.
cuDNN builds an execution plan per shape, a costly stall the first time a shape is met
(docs/benchmarks/design-measurements.md#sdpa-length-bucket), and these roundings bound the shapes
a run meets.

The keys are first gathered from the paged cache into contiguous [rows, kv_heads, head_dim]
buffers in the model's dtype (an fp8 cache converted, as the kernels convert it), through cache
rows the backend computes once a step (every layer reads the same positions): at a 128k context
the gather is a small fraction of the layer's attention time
(docs/benchmarks/design-measurements.md#sdpa-extend-key-gather). The buffers, the padded queries
and both parts' outputs are this path's memory beyond the profiled step, which the runner
reserves (workspace_bytes).

On the CPU (the Triton backend's tests, under Triton's interpreter) the parts run on torch's CPU
flash kernel, which also returns its log-sum-exp: the same split and merge, checked against the
reference backend without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Query and key counts of both parts are multiples of this (one cuDNN plan per shape).
LENGTH_BUCKET = 256
# The prefix part's keys are a multiple of this; the diagonal part takes the rest of the prefix.
PREFIX_BUCKET = 4096
# (queries, cached keys): a chunk with at least both of either pair goes this way. Measured on the
# GPU (docs/benchmarks/design-measurements.md#sdpa-extend): from these shapes up this path beats the
# paged kernel's device time (narrowly at 2,048 queries on 2,048 keys, clearly at 1,024 on 8,192
# and above); 1,024 queries on 4,096 keys or fewer ran slower than the paged kernel (the gather,
# the two launches and the leading queries weigh more than the faster kernel).
EXTEND_MIN_SHAPES = ((2048, 2048), (1024, 8192))


def takes(start: int, num_tokens: int) -> bool:
    """Whether a chunk of `num_tokens` queries after `start` cached positions goes this way."""
    return any(num_tokens >= tokens and start >= context for tokens, context in EXTEND_MIN_SHAPES)


# Head sizes this path takes on CUDA. 256 (Gemma 3) also matches dense attention on the GPU
# (tests/unit/test_sdpa_extend.py; docs/benchmarks/design-measurements.md#sdpa-extend-head-sizes),
# but its speed against the paged kernel at that size is not measured, so those layers stay in the
# kernel.
MAX_HEAD_SIZE = 128


def supported(device: torch.device, head_size: int) -> bool:
    """Whether this device runs the parts: cuDNN's kernel through torch on CUDA (head sizes up to
    MAX_HEAD_SIZE, multiples of 8), torch's CPU flash kernel on the CPU (tests)."""
    if device.type != "cuda":
        return True
    return (torch.backends.cudnn.is_available() and head_size <= MAX_HEAD_SIZE and head_size % 8 == 0
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gathered_rows(start: int, num_tokens: int) -> int:
    """Rows of the key (and value) buffer of a chunk: its keys, then the diagonal part's padding
    (room for the chunk's queries rounded up, after the leading ones, so that the prefix part's
    queries are a slice of the diagonal part's)."""
    split = start // PREFIX_BUCKET * PREFIX_BUCKET
    return split + _round_up(start - split + _round_up(num_tokens, LENGTH_BUCKET), LENGTH_BUCKET)


def workspace_bytes(max_len: int, max_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """A bound on the memory one layer's call holds at once, for chunks of at most `max_tokens`
    queries ending at most at `max_len`: keys and values, both parts' queries and outputs (the
    log-sum-exps are 1/head_dim of an output, in float32)."""
    max_tokens = min(max_tokens, max_len - min(context for _, context in EXTEND_MIN_SHAPES))   # after a prefix
    keys = _round_up(max_len, LENGTH_BUCKET) + PREFIX_BUCKET + LENGTH_BUCKET
    queries = _round_up(max_tokens, LENGTH_BUCKET) + PREFIX_BUCKET + LENGTH_BUCKET   # the diagonal part's
    size = torch.empty((), dtype=dtype).element_size()
    return size * head_dim * (2 * keys * num_kv_heads + 4 * queries * num_heads) + 8 * queries * num_heads


def gather_keys(cache: torch.Tensor, slots: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows `slots` (int64, a sequence's positions in order) of a paged cache [cache rows,
    kv_heads, head_dim], as `rows` contiguous rows in `dtype`; the rows past them are zeros (a
    masked key's value still enters the products, as 0 x value: it must be finite)."""
    length = slots.shape[0]
    out = torch.empty(rows, *cache.shape[1:], dtype=dtype, device=cache.device)
    if cache.dtype == dtype:   # straight into the buffer: no cache-sized temporary
        torch.index_select(cache, 0, slots, out=out[:length])
    else:
        out[:length] = cache.index_select(0, slots)
    out[length:] = 0
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q: [Lq, H, D], k/v: [Lk, Hkv, D], token-major ->
    ([Lq, H, D] (a view), [H, Lq] float32, natural log). Causal aligns top-left."""
    if q.device.type == "cuda":
        q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q4, k4, v4, None, True, 0.0, causal, False, scale=scale)[:2]
    else:   # the CPU kernel takes as many K/V heads as query heads
        group = q.shape[1] // k.shape[1]
        q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k.repeat_interleave(group, 1),
                                                               v.repeat_interleave(group, 1)))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0])


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [C, H, D], the queries of positions [start, start + C); keys/values: that sequence's
    gather_keys rows (positions [0, start + C), then zeros to gathered_rows) -> `out` [C, H, D]."""
    num_tokens = q.shape[0]
    if out is None:
        out = torch.empty_like(q)
    split = start // PREFIX_BUCKET * PREFIX_BUCKET
    lead = start - split
    diag_len = keys.shape[0] - split   # a multiple of LENGTH_BUCKET (gathered_rows)
    q_diag = F.pad(q, (0, 0, 0, 0, lead, diag_len - lead - num_tokens))
    out_diag, lse_diag = _attend(q_diag, keys[split:], values[split:], True, scale)
    out_diag, lse_diag = out_diag[lead:lead + num_tokens], lse_diag[:, lead:lead + num_tokens]
    if split == 0:
        return out.copy_(out_diag)
    q_pre = q_diag[lead:lead + _round_up(num_tokens, LENGTH_BUCKET)]   # the chunk's, then zero rows
    out_pre, lse_pre = _attend(q_pre, keys[:split], values[:split], False, scale)
    merge_parts(out_pre[:num_tokens], lse_pre[:, :num_tokens], out_diag, lse_diag, out)
    return out


@triton.jit
def _merge_kernel(a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, out_ptr, num_tokens,
                  stride_at, stride_ah, stride_bt, stride_bh, stride_lah, stride_lat, stride_lbh, stride_lbt,
                  stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    ok = tokens < num_tokens
    dims = tl.arange(0, DIM_PAD)
    mask = ok[:, None] & (dims < HEAD_DIM)[None, :]
    lse_a = tl.load(lse_a_ptr + head * stride_lah + tokens * stride_lat, mask=ok, other=0.0)
    lse_b = tl.load(lse_b_ptr + head * stride_lbh + tokens * stride_lbt, mask=ok, other=0.0)
    share_a = tl.sigmoid(lse_a - lse_b)   # exp(lse_a) / (exp(lse_a) + exp(lse_b)), no overflow
    a = tl.load(a_ptr + tokens[:, None] * stride_at + head * stride_ah + dims[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + tokens[:, None] * stride_bt + head * stride_bh + dims[None, :], mask=mask, other=0.0)
    merged = b.to(tl.float32) + share_a[:, None] * (a.to(tl.float32) - b.to(tl.float32))
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)


def merge_parts(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """Attention over keys A and B from each part's output ([C, H, D], last dim contiguous) and
    log-sum-exp ([H, C]): the parts weighted by their shares of the softmax's mass, computed in
    float32 and written to `out` once."""
    num_tokens, num_heads, head_dim = a.shape
    if not a.stride(2) == b.stride(2) == out.stride(2) == 1:
        raise ValueError("merge_parts reads and writes rows whose last dimension is contiguous")
    block_t = 32
    _merge_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        a, b, lse_a, lse_b, out, num_tokens, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        *lse_a.stride(), *lse_b.stride(), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_T=block_t)
    return out
