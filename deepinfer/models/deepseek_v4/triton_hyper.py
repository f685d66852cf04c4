"""mHC's stream mixing (hyper.py) in Triton kernels: two launches before a block, one after.

hyper.py's HyperConnection, in PyTorch, is some sixty small kernels a layer side at decode (the
norm, the mixing projection, sigmoids, a softmax and a Sinkhorn of 20 passes over a 4 x 4 matrix
per token), and they, not bytes, set the time of a decode step. Here:

  hc_mixes   the projection of the normed, flattened streams, x / rms(x) @ fn.T: the rms is a
             factor of the token, so each program takes a slice of the N * hidden inputs for a
             block of tokens and writes its partial dot products and partial sum of squares
             (split over the inputs: at batch 1 the projection's 1.5 MB of fn is read by many
             programs at once, not one);
  hc_finish  per token: the partials summed, scaled by 1 / rms, then pre / post / comb as
             hyper.py computes them (the Sinkhorn passes on an N x N tile in registers) and the
             block input sum_j pre_j X_j, one slice of hidden a program;
  hc_merge   X'_k = post_k * out + sum_j comb[j, k] X_j, one slice of hidden a program.
HyperHead's collapse is hc_mixes and hc_finish with pre alone. All float32 inside, rounded once to
the streams' dtype; hyper.py is the reference they are tested against (tests/models/test_v4_fused.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16        # tokens a mixing program takes (a tensor-core dot needs 16 rows)
BLOCK_T_LONG = 64   # ... from LONG_STEP tokens on (a prefill): fn is re-read once a block of tokens
LONG_STEP = 1024
BLOCK_K = 64        # inputs a mixing program takes per iteration
BLOCK_H = 512       # hidden channels a finish / merge program takes
TARGET_PROGRAMS = 256   # the mixing split over the inputs aims at this many programs


@triton.jit
def _hc_mixes_kernel(x_ptr, fn_ptr, part_ptr, ss_ptr, T, K, M, CHUNK, stride_xt, stride_fn,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, IEEE: tl.constexpr):
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    outs = tl.arange(0, M_PAD)
    token_ok = tokens < T
    acc = tl.zeros((BLOCK_T, M_PAD), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_xt + ks[None, :],
                    mask=token_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + outs[None, :] * stride_fn + ks[:, None], mask=k_ok[:, None] & (outs < M)[None, :],
                    other=0.0)
        if IEEE:   # float32 streams: exact products
            acc += tl.dot(x, w, input_precision="ieee")
        else:      # 16-bit streams: three TF32 products, float32's accuracy on the tensor cores
            acc += tl.dot(x, w, input_precision="tf32x3")
        ss += tl.sum(x * x, axis=1)
    part = part_ptr + (tokens[:, None].to(tl.int64) * splits + split) * M_PAD + outs[None, :]
    tl.store(part, acc, mask=token_ok[:, None])
    tl.store(ss_ptr + tokens.to(tl.int64) * splits + split, ss, mask=token_ok)


@triton.jit
def _split_sum(part_ptr, token, splits, offsets, mask, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """One token's partial mixes at `offsets` [R] summed over the splits ([S_PAD, R] reduced)."""
    s = tl.arange(0, S_PAD)
    rows = part_ptr + (token * splits + s[:, None]) * M_PAD + offsets[None, :]
    return tl.sum(tl.load(rows, mask=(s < splits)[:, None] & mask[None, :], other=0.0), axis=0)


@triton.jit
def _split_sum_2d(part_ptr, token, splits, offsets, mask, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """_split_sum for a tile of offsets [R, C] ([S_PAD, R, C] reduced)."""
    s = tl.arange(0, S_PAD)
    rows = part_ptr + (token * splits + s[:, None, None]) * M_PAD + offsets[None, :, :]
    return tl.sum(tl.load(rows, mask=(s < splits)[:, None, None] & mask[None, :, :], other=0.0), axis=0)


@triton.jit
def _hc_finish_kernel(x_ptr, part_ptr, ss_ptr, base_ptr, scale_ptr, block_in_ptr, post_ptr, comb_ptr,
                      splits, K, H, eps, norm_eps, stride_xt, stride_xn,
                      N: tl.constexpr, N_PAD: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr,
                      ITERS: tl.constexpr, HEAD: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_PAD)
    j = tl.arange(0, N_PAD)
    i_ok = i < N
    s = tl.arange(0, S_PAD)
    ss = tl.sum(tl.load(ss_ptr + token * splits + s, mask=s < splits, other=0.0), axis=0)
    rstd = tl.rsqrt(ss / K + norm_eps)
    a = _split_sum(part_ptr, token, splits, i, i_ok, S_PAD, M_PAD) * rstd
    pre = tl.sigmoid(a * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + eps
    pre = tl.where(i_ok, pre, 0.0)
    if not HEAD:
        if tl.program_id(1) == 0:   # post and comb once a token
            b = _split_sum(part_ptr, token, splits, N + i, i_ok, S_PAD, M_PAD) * rstd
            post = 2 * tl.sigmoid(b * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))
            tl.store(post_ptr + token * N + i, post, mask=i_ok)
            cell = i[:, None] * N + j[None, :]
            cell_ok = i_ok[:, None] & (j < N)[None, :]
            c = _split_sum_2d(part_ptr, token, splits, 2 * N + cell, cell_ok, S_PAD, M_PAD) * rstd
            c = c * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cell, mask=cell_ok, other=0.0)
            # Softmax along each row, + eps; padding cells 0 so they add nothing to any sum.
            c = tl.where(cell_ok, c, -1.0e30)
            c = tl.exp(c - tl.max(c, axis=1)[:, None])
            c = tl.where(cell_ok, c / tl.sum(c, axis=1)[:, None] + eps, 0.0)
            # Sinkhorn as hyper.sinkhorn: columns, then (rows, columns) ITERS - 1 times.
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
            for _ in tl.static_range(ITERS - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + eps)
                c = c / (tl.sum(c, axis=0)[None, :] + eps)
            tl.store(comb_ptr + token * N * N + cell, c, mask=cell_ok)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    x = tl.load(x_ptr + token * stride_xt + i[:, None] * stride_xn + h[None, :],
                mask=i_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    block_in = tl.sum(pre[:, None] * x, axis=0)
    tl.store(block_in_ptr + token * H + h, block_in.to(block_in_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _hc_merge_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, H, stride_xt, stride_xn, stride_ot,
                     N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, N_PAD)   # source streams
    k = tl.arange(0, N_PAD)   # new streams
    h_ok = h < H
    x = tl.load(x_ptr + token * stride_xt + j[:, None] * stride_xn + h[None, :],
                mask=(j < N)[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + token * N * N + j[:, None] * N + k[None, :],
                   mask=(j < N)[:, None] & (k < N)[None, :], other=0.0)
    post = tl.load(post_ptr + token * N + k, mask=k < N, other=0.0)
    out = tl.load(out_ptr + token * stride_ot + h, mask=h_ok, other=0.0).to(tl.float32)
    new = post[:, None] * out[None, :] + tl.sum(comb[:, :, None] * x[:, None, :], axis=0)
    tl.store(new_ptr + token * N * H + k[:, None] * H + h[None, :], new.to(new_ptr.dtype.element_ty),
             mask=(k < N)[:, None] & h_ok[None, :])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Streams [..., N, hidden] as [tokens, N, hidden] with the hidden channels contiguous."""
    x = x.reshape(-1, *x.shape[-2:])
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float,
         iters: int, head: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    tokens, n, hidden = rows.shape
    k, m = n * hidden, fn.shape[0]
    m_pad = max(16, triton.next_power_of_2(m))
    block_t = BLOCK_T_LONG if tokens >= LONG_STEP else BLOCK_T
    t_blocks = triton.cdiv(tokens, block_t)
    splits = max(1, min(triton.cdiv(k, BLOCK_K), triton.cdiv(TARGET_PROGRAMS, t_blocks)))
    chunk = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, chunk)
    part = torch.empty(tokens, splits, m_pad, dtype=torch.float32, device=x.device)
    ss = torch.empty(tokens, splits, dtype=torch.float32, device=x.device)
    block_in = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=x.device)
    if tokens:
        fn = fn.contiguous()
        _hc_mixes_kernel[(t_blocks, splits)](rows, fn, part, ss, tokens, k, m, chunk, rows.stride(0), fn.stride(0),
                                             BLOCK_T=block_t, BLOCK_K=BLOCK_K, M_PAD=m_pad,
                                             IEEE=x.dtype == torch.float32)
        _hc_finish_kernel[(tokens, triton.cdiv(hidden, BLOCK_H))](
            rows, part, ss, base, scale, block_in, post, comb, splits, k, hidden, eps, norm_eps,
            rows.stride(0), rows.stride(1), N=n, N_PAD=triton.next_power_of_2(n), M_PAD=m_pad,
            S_PAD=triton.next_power_of_2(splits), ITERS=iters, HEAD=head, BLOCK_H=BLOCK_H)
    lead = x.shape[:-2]
    return block_in.view(*lead, hidden), post.view(*lead, n), comb.view(*lead, n, n)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
           norm_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HyperConnection.forward: streams x [..., N, hidden] -> (block input [..., hidden] in x's
    dtype, post [..., N], comb [..., N, N] in float32)."""
    return _mix(x, fn, base, scale, eps, norm_eps, iters, head=False)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """HyperHead.forward: streams x [..., N, hidden] -> [..., hidden] in x's dtype."""
    return _mix(x, fn, base, scale, eps, norm_eps, 1, head=True)[0]


def hc_merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """HyperConnection.merge: the new streams [..., N, hidden] in x's dtype from the old x, the
    block's output out [..., hidden], post [..., N] and comb [..., N, N]."""
    rows = _rows(x)
    tokens, n, hidden = rows.shape
    out_rows = out.reshape(tokens, hidden)
    out_rows = out_rows if out_rows.stride(-1) == 1 else out_rows.contiguous()
    new = torch.empty(tokens, n, hidden, dtype=x.dtype, device=x.device)
    if tokens:
        _hc_merge_kernel[(tokens, triton.cdiv(hidden, BLOCK_H))](
            rows, out_rows, post.reshape(tokens, n).contiguous(), comb.reshape(tokens, n, n).contiguous(), new,
            hidden, rows.stride(0), rows.stride(1), out_rows.stride(0),
            N=n, N_PAD=triton.next_power_of_2(n), BLOCK_H=BLOCK_H)
    return new.view(x.shape)
