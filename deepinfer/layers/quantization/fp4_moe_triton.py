"""The grouped product of a mixture of experts whose weights are FP4 (fp4.py), in one Triton kernel.

    out[r] = x[r] @ W[e(r)].T     for the rows r of x sorted by expert, expert e owning the rows
                                  starts[e] <= r < ends[e]

W[e] is read as stored (uint8 [E, N, K/2] codes, uint8 [E, N, K/G] ue8m0 exponents): each
program loads a BLOCK_N x BLOCK_K tile of codes, decodes it in registers (the low nibble of a byte
is the even column; e2m1 as fp4.py says; times 2^(exponent - 127) per group of G inputs), casts it
to the activations' dtype and multiplies on the tensor cores, accumulating in float32.

The grid is (tiles, N / BLOCK_N) with `tiles` an upper bound known from the shapes alone (every
expert's rows in BLOCK_M tiles: at most ceil(rows / BLOCK_M) plus one per expert with rows, of
which there are at most min(E, rows): at decode a handful, not E); a program finds its expert by a
binary search over the cumulative tile counts, computed on the device, and the programs past the
last tile return at once. Nothing waits for the host, so the product fits a CUDA graph.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer.layers.quantization import fp4

logger = logging.getLogger(__name__)

_works: dict[str, bool] = {}


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32 values, built as float32 bits (no exp2 per weight):
    exponent e > 0 is 2^(e - 1) * (1 + m / 2), bits ((e + 126) << 23) | (m << 22); e = 0 is m / 2,
    bits of 0.5 (126 << 23) or 0; bit 3 the sign."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    bits = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_grouped_kernel(x_ptr, codes_ptr, exps_ptr, out_ptr, starts_ptr, ends_ptr, tile_ends_ptr,
                        num_experts, N, K,
                        stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_om,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tile >= tl.load(tile_ends_ptr + num_experts - 1):
        return
    # The expert of this tile: the first e whose cumulative tile count exceeds `tile`.
    lo = 0
    hi = num_experts - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(tile_ends_ptr + mid) > tile:
            hi = mid
        else:
            lo = mid + 1
    expert = lo
    first_tile = tl.load(tile_ends_ptr + expert - 1, mask=expert > 0, other=0)
    row_start = tl.load(starts_ptr + expert) + (tile - first_tile) * BLOCK_M
    row_end = tl.load(ends_ptr + expert)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    half = tl.arange(0, BLOCK_K // 2)
    groups = tl.arange(0, BLOCK_K // GROUP)
    ks = tl.arange(0, BLOCK_K)
    code_rows = codes_ptr + expert.to(tl.int64) * stride_ce + cols[:, None].to(tl.int64) * stride_cn
    exp_rows = exps_ptr + expert.to(tl.int64) * stride_se + cols[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None], other=0.0)
        packed = tl.load(code_rows + (k0 // 2 + half)[None, :], mask=col_ok[:, None], other=0).to(tl.int32)
        codes = tl.interleave(packed & 0xF, packed >> 4)                  # [BLOCK_N, BLOCK_K]
        exps = tl.load(exp_rows + (k0 // GROUP + groups)[None, :], mask=col_ok[:, None], other=127)
        # 2^(byte - 127) as float32 bits: the byte is the exponent field (ue8m0 writes 1..254 here).
        scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)     # [BLOCK_N, BLOCK_K / GROUP]
        values = tl.reshape(_e2m1(codes), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
        w = tl.reshape(values, (BLOCK_N, BLOCK_K)).to(a.dtype)
        acc += tl.dot(a, tl.trans(w))
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp4_grouped_mm(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor, counts: torch.Tensor,
                   block_m: int | None = None, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """x [rows, K] sorted by expert, expert e's rows being counts[e] consecutive ones (counts [E],
    on x's device); codes uint8 [E, N, K/2], exponents uint8 [E, N, K/G] -> [rows, N] in x's dtype.
    block_m (None: by the rows an expert has on average, from the shapes alone): each program
    decodes its weight tile once for BLOCK_M rows, so many rows an expert (prefill) take taller
    tiles, few (decode) short ones that waste no rows."""
    rows, k = x.shape
    num_experts, n, packed_k = codes.shape
    group = k // exponents.shape[-1]
    if packed_k * 2 != k or k % block_k or block_k % group:
        raise ValueError(f"fp4_grouped_mm: inputs {k} must be twice the codes' {packed_k} and a multiple of "
                         f"{block_k}, itself a multiple of the scale group {group}")
    if block_m is None:
        block_m = 64 if rows >= 64 * num_experts else 16
    x = x.contiguous()
    counts = counts.to(torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    starts = ends - counts
    tile_ends = ((counts + block_m - 1) // block_m).cumsum(0, dtype=torch.int32)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, block_m) + min(num_experts, rows), triton.cdiv(n, block_n))
    _fp4_grouped_kernel[grid](x, codes, exponents, out, starts, ends, tile_ends, num_experts, n, k,
                              x.stride(0), codes.stride(0), codes.stride(1), exponents.stride(0),
                              exponents.stride(1), out.stride(0),
                              GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def kernel_works(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel compiles on this device and matches the dequantized reference on a
    small product (activations in `dtype`, three experts, one without rows): asked once a device
    and dtype, so a Triton that cannot build it sends the experts to the reference loop instead
    of failing a step."""
    key = f"{device}:{dtype}"
    if key not in _works:
        try:
            generator = torch.Generator(device=device).manual_seed(0)
            codes, exps = fp4.quantize(torch.randn(3, 64, 128, device=device, generator=generator), 32)
            x = torch.randn(20, 128, device=device, generator=generator).to(dtype)
            counts = torch.tensor([12, 0, 8], device=device)
            got = fp4_grouped_mm(x, codes, exps, counts).float()
            want = torch.cat([F.linear(x[:12].float(), fp4.dequantize(codes[0], exps[0])),
                              F.linear(x[12:].float(), fp4.dequantize(codes[2], exps[2]))])
            _works[key] = bool(torch.allclose(got, want, atol=0.5, rtol=0.02))
            if not _works[key]:
                logger.warning("the FP4 experts' kernel gave wrong products on %s; FP4 experts are dequantized", device)
        except Exception as e:   # a Triton that cannot compile it: the reference serves
            logger.warning("the FP4 experts' kernel does not run on %s (%s); FP4 experts are dequantized",
                           device, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
            _works[key] = False
    return _works[key]
