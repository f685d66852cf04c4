"""The grouped product of a mixture of experts whose weights are FP4 (fp4.py), in one Triton kernel.

    out[r] = x[r] @ W[e(r)].T     for the rows r of x sorted by expert, expert e owning the rows
                                  starts[e] <= r < ends[e]

W[e] is read as stored (uint8 [E, N, K/2] codes, uint8 [E, N, K/G] ue8m0 exponents): each
program loads a BLOCK_K / 2 x BLOCK_N tile of code bytes and decodes it in registers (e2m1 as
fp4.py says, times 2^(exponent - 127) per group of G inputs) into the weights of the even inputs
(low nibbles) and of the odd ones (high nibbles), then multiplies: on the tensor cores in the
activations' dtype when an expert has many rows (prefill), as float32 multiply-adds when it has a
few (decode, where the bytes read are the cost), accumulating in float32 either way.

The grid is (tiles, N / BLOCK_N) with `tiles` an upper bound known from the shapes alone (every
expert's rows in BLOCK_M tiles: at most ceil(rows / BLOCK_M) plus one per expert with rows, of
which there are at most min(E, rows): at decode a handful, not E); a program finds its expert by a
binary search over the cumulative tile counts, computed on the device, and the programs past the
last tile return at once. Nothing waits for the host, so the product fits a CUDA graph.

At decode sizes the kernel is bound by its instructions a weight, not by the bytes it reads
(benchmarks/fp4_sass_count.py counts them from the compiled kernel), so on NVIDIA GPUs the codes
are decoded in PTX, four bytes at a time (_E2M1_PAIRS_ASM), and under Triton's interpreter by the
plain ops (_e2m1) the tests hold the PTX to. TileConfig's `group_scales`, `split_k` and `bf16_ptx`
are tilings of the same product the tuner weighs.

A tiling with `fp8` multiplies on the FP8 tensor cores instead (_fp4_fp8_kernel): the activations
quantized to e4m3 per row and 128 inputs (fp8.quantize_rows, as DeepSeek's FP8 products take
them), each e2m1 weight turned into the e4m3 byte worth value * 2^-6 (exact: e4m3 holds every
e2m1 value) by three integer ops, one dot per scale group. Fewer operations a weight than the
float decode; it approximates the activations as the FP8 projections do (benchmarks/fp4_moe_tune.py
measures both).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.layers.quantization import fp4, fp8

logger = logging.getLogger(__name__)

_works: dict[str, bool] = {}


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> their values times 2^-14, float32 (callers take the 2^14 back
    in the group's scale, _scale). Decoding is the kernels' arithmetic per weight, so it is a few
    integer ops and one conversion: the code's magnitude bits at bits 11..9 of a float16 (the
    exponent field's two low bits, the mantissa's top bit) and its sign at bit 15 are a float16
    worth exactly value * 2^-14 (exponent e > 0: 2^(e - 15) * (1 + m / 2); e = 0: the subnormal
    m / 2 * 2^-14), which converts exactly."""
    half = ((code & 7) << 9) | ((code & 8) << 12)
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# Four code bytes -> their eight e2m1 values as float16 bits (_e2m1's, value * 2^-14), the low
# nibbles' in $0-$1 and the high nibbles' in $2-$3 (two a register, element i in the low half of
# its register first), with 32-bit integer ops on two values at once: each pair of bytes spread
# to the low byte of each half (prmt), then per half the magnitude bits to 11..9 and the sign to
# 15, as _e2m1 does one value at a time (about a quarter of its instructions a weight).
_E2M1_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 q<2>, t<2>;
prmt.b32 q0, $4, 0, 0x4140;
prmt.b32 q1, $4, 0, 0x4342;
shl.b32 t0, q0, 9;  and.b32 t0, t0, 0x0E000E00;  shl.b32 t1, q0, 12; and.b32 t1, t1, 0x80008000; or.b32 $0, t0, t1;
shl.b32 t0, q1, 9;  and.b32 t0, t0, 0x0E000E00;  shl.b32 t1, q1, 12; and.b32 t1, t1, 0x80008000; or.b32 $1, t0, t1;
shl.b32 t0, q0, 5;  and.b32 t0, t0, 0x0E000E00;  shl.b32 t1, q0, 8;  and.b32 t1, t1, 0x80008000; or.b32 $2, t0, t1;
shl.b32 t0, q1, 5;  and.b32 t0, t0, 0x0E000E00;  shl.b32 t1, q1, 8;  and.b32 t1, t1, 0x80008000; or.b32 $3, t0, t1;
}
""")


# _E2M1_PAIRS_ASM's decode made bfloat16 and scaled in the same registers: the codes' bits placed
# in a bfloat16 worth value * 2^-126 (code 1, 0.5, is the one subnormal), times each code byte's
# scale as bfloat16 ($5: elements 0 and 1, $6: 2 and 3; _bf16_scale) by one bfloat16x2 multiply a
# register: exact, every product being a normal bfloat16.
_E2M1_SCALED_BF16_ASM = tl.constexpr("""
{
.reg .b32 q<2>, t<2>;
prmt.b32 q0, $4, 0, 0x4140;
prmt.b32 q1, $4, 0, 0x4342;
shl.b32 t0, q0, 6;  and.b32 t0, t0, 0x01C001C0;  shl.b32 t1, q0, 12; and.b32 t1, t1, 0x80008000; or.b32 t0, t0, t1; mul.rn.bf16x2 $0, t0, $5;
shl.b32 t0, q1, 6;  and.b32 t0, t0, 0x01C001C0;  shl.b32 t1, q1, 12; and.b32 t1, t1, 0x80008000; or.b32 t0, t0, t1; mul.rn.bf16x2 $1, t0, $6;
shl.b32 t0, q0, 2;  and.b32 t0, t0, 0x01C001C0;  shl.b32 t1, q0, 8;  and.b32 t1, t1, 0x80008000; or.b32 t0, t0, t1; mul.rn.bf16x2 $2, t0, $5;
shl.b32 t0, q1, 2;  and.b32 t0, t0, 0x01C001C0;  shl.b32 t1, q1, 8;  and.b32 t1, t1, 0x80008000; or.b32 t0, t0, t1; mul.rn.bf16x2 $3, t0, $6;
}
""")


@triton.jit
def _e2m1_nibbles(packed, ASM: tl.constexpr):
    """Code bytes (uint8) -> (low nibbles' values, high nibbles'), float32 worth value * 2^-14 as
    _e2m1 gives them. ASM: four bytes at a time in PTX (_E2M1_PAIRS_ASM; CUDA only), else _e2m1
    on each nibble (Triton's interpreter, and the reference the tests hold the PTX to)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(_E2M1_PAIRS_ASM, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        return low.to(tl.float32), high.to(tl.float32)
    codes = packed.to(tl.int32)
    return _e2m1(codes & 0xF), _e2m1(codes >> 4)


@triton.jit
def _scale(exps):
    """ue8m0 exponent bytes -> 2^(byte - 127) * 2^14 (_e2m1's factor), float32 made from its bits
    (the byte plus 14 is the exponent field: exact for bytes up to 240, scales up to 2^113)."""
    return ((exps.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


# The bfloat16 PTX path's weights are the true ones times 2^-BF16_SHIFT, its products' sums
# multiplied back by 2^BF16_SHIFT (exact: powers of two): the scale that makes the decoded
# value * 2^-126 a weight, 2^(exponent - 127) * 2^126, is a bfloat16 only up to exponent 128,
# while 2^(exponent - 127 + 126 - BF16_SHIFT) is one for exponents 27..154 (scales 2^-100..2^27).
BF16_SHIFT = tl.constexpr(26)


@triton.jit
def _bf16_scale(exps):
    """ue8m0 exponent bytes -> 2^(byte - 127 + 126 - BF16_SHIFT) as bfloat16, from its bits (the
    exponent field byte + 100); bytes outside 27..154 are clamped into it (scales beyond 2^-100 and
    2^27, which no checkpoint writes)."""
    biased = tl.minimum(tl.maximum(exps.to(tl.int32), 27), 154) + (126 - BF16_SHIFT)
    return (biased << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scaled_weights(packed, exps, KIND: tl.constexpr, ASM: tl.constexpr, BF16_PTX: tl.constexpr):
    """Code bytes and their groups' exponent bytes (the bytes' shape, or one that broadcasts to it:
    each scale is then made once a group) -> (even inputs' weights, odd inputs') in KIND. ASM and
    BF16_PTX with bfloat16: _E2M1_SCALED_BF16_ASM, the weights times 2^-BF16_SHIFT (the caller
    multiplies the products back: _weights_shift); else decoded (_e2m1_nibbles), scaled in float32
    (_scale) and converted."""
    if ASM and BF16_PTX and KIND == tl.bfloat16:
        scale = tl.broadcast_to(_bf16_scale(exps), packed.shape)
        even, odd = tl.inline_asm_elementwise(_E2M1_SCALED_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return even, odd
    scale = _scale(exps)
    low, high = _e2m1_nibbles(packed, ASM)
    return (low * scale).to(KIND), (high * scale).to(KIND)


@triton.jit
def _weights_shift(KIND: tl.constexpr, ASM: tl.constexpr, BF16_PTX: tl.constexpr):
    """What the products of _scaled_weights' weights are multiplied by to be the true ones."""
    if ASM and BF16_PTX and KIND == tl.bfloat16:
        return 2.0 ** BF16_SHIFT
    return 1.0


@triton.jit
def _expert_rows(tile, starts_ptr, ends_ptr, tile_ends_ptr, num_experts, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of BLOCK_M-row tile `tile`: the expert is the first e whose
    cumulative tile count exceeds `tile` (a binary search, on the device)."""
    lo = 0
    hi = num_experts - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(tile_ends_ptr + mid) > tile:
            hi = mid
        else:
            lo = mid + 1
    first_tile = tl.load(tile_ends_ptr + lo - 1, mask=lo > 0, other=0)
    return lo, tl.load(starts_ptr + lo) + (tile - first_tile) * BLOCK_M, tl.load(ends_ptr + lo)


@triton.jit
def _fp4_grouped_kernel(x_ptr, codes_ptr, exps_ptr, out_ptr, starts_ptr, ends_ptr, tile_ends_ptr,
                        num_experts, N, K,
                        stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_om, stride_os,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
                        ASM: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_SCALES: tl.constexpr,
                        BF16_PTX: tl.constexpr, GEMV_STAGES: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tile >= tl.load(tile_ends_ptr + num_experts - 1):
        return
    expert, row_start, row_end = _expert_rows(tile, starts_ptr, ends_ptr, tile_ends_ptr, num_experts, BLOCK_M)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    code_base = codes_ptr + expert.to(tl.int64) * stride_ce
    exp_base = exps_ptr + expert.to(tl.int64) * stride_se
    # Split K: program (.., .., s) takes the s-th of SPLIT_K equal runs of the inputs and writes
    # its partial sums to plane s of a float32 output that the caller sums.
    k_len = K // SPLIT_K
    # (a multiple of BLOCK_K, said so: the loads of each K block stay aligned and vectorized)
    k_first = tl.multiple_of(tl.program_id(2) * k_len, BLOCK_K)
    if USE_DOT:
        KIND: tl.constexpr = x_ptr.dtype.element_ty   # the weights' dtype in the dots: the activations'
        # A K block's codes are read as [BLOCK_K / 2 bytes, BLOCK_N]: byte p of a row holds inputs
        # 2p (low nibble) and 2p + 1 (high), so the low nibbles multiply the even inputs and the
        # high the odd ones, two products of BLOCK_K / 2 with no interleaving of decoded values.
        half = tl.arange(0, BLOCK_K // 2)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        code_cols = code_base + cols[None, :].to(tl.int64) * stride_cn
        exp_cols = exp_base + cols[None, :].to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, k_first + k_len, BLOCK_K):
            byte = k0 // 2 + half
            if GROUP_SCALES:
                # Codes as [groups, G / 2, BLOCK_N], so each group's exponent is loaded and turned
                # into its scale once and broadcast over the group's bytes; the scaled weights are
                # then reshaped to the dot's [BLOCK_K / 2, BLOCK_N].
                g = tl.arange(0, BLOCK_K // GROUP)[:, None, None]
                j = tl.arange(0, GROUP // 2)[None, :, None]
                packed = tl.load(code_cols[None, :, :] + (k0 // 2 + g * (GROUP // 2) + j), mask=col_ok[None, None, :], other=0)
                exps = tl.load(exp_cols[None, :, :] + (k0 // GROUP + g), mask=col_ok[None, None, :], other=127)
                w_even, w_odd = _scaled_weights(packed, exps, KIND, ASM, BF16_PTX)
                w_even = tl.reshape(w_even, (BLOCK_K // 2, BLOCK_N))
                w_odd = tl.reshape(w_odd, (BLOCK_K // 2, BLOCK_N))
            else:
                packed = tl.load(code_cols + byte[:, None], mask=col_ok[None, :], other=0)
                # A group's exponent for each of its G / 2 bytes (repeated loads of one byte:
                # cached). Scaling the partial products instead (a pair of dots per scale group,
                # one exponent load and multiply per output and group) was slower: the K=16 dots
                # cost more than the loads and multiplies they save (design-measurements.md, FP4
                # expert tiles).
                exps = tl.load(exp_cols + (byte // (GROUP // 2))[:, None], mask=col_ok[None, :], other=127)
                w_even, w_odd = _scaled_weights(packed, exps, KIND, ASM, BF16_PTX)       # [BLOCK_K / 2, BLOCK_N]
            a_even = tl.load(x_rows + (k0 + 2 * half)[None, :], mask=row_ok[:, None], other=0.0)
            a_odd = tl.load(x_rows + (k0 + 2 * half + 1)[None, :], mask=row_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(a_even, w_even, input_precision="ieee")
                acc += tl.dot(a_odd, w_odd, input_precision="ieee")
            else:
                acc += tl.dot(a_even, w_even)
                acc += tl.dot(a_odd, w_odd)
        acc = acc * _weights_shift(KIND, ASM, BF16_PTX)
    else:
        # One row (BLOCK_M == 1): a GEMV. The codes are read as [groups, G / 2 bytes, BLOCK_N], so
        # a group's exponent is loaded once and multiplies its partial sum, and the products are
        # summed in registers and reduced once at the end.
        g = tl.arange(0, BLOCK_K // GROUP)[:, None, None]
        j = tl.arange(0, GROUP // 2)[None, :, None]
        c3 = cols[None, None, :].to(tl.int64)
        ok3 = col_ok[None, None, :]
        x_row = x_ptr + row_start.to(tl.int64) * stride_xm
        one_row = row_start < row_end
        partial = tl.zeros((BLOCK_K // GROUP, GROUP // 2, BLOCK_N), dtype=tl.float32)
        # GEMV_STAGES > 1: the loads of later K blocks in flight while this one is summed (async
        # copies through shared memory: more instructions, more bytes in flight).
        for k0 in tl.range(k_first, k_first + k_len, BLOCK_K, num_stages=GEMV_STAGES):
            byte = k0 // 2 + g * (GROUP // 2) + j                           # [groups, G / 2, 1]
            packed = tl.load(code_base + c3 * stride_cn + byte, mask=ok3, other=0)
            exps = tl.load(exp_base + c3 * stride_sn + k0 // GROUP + g, mask=ok3, other=127)
            scale = _scale(exps)                                            # [groups, 1, BLOCK_N]
            low, high = _e2m1_nibbles(packed, ASM)
            a_even = tl.load(x_row + 2 * byte, mask=one_row, other=0.0).to(tl.float32)
            a_odd = tl.load(x_row + 2 * byte + 1, mask=one_row, other=0.0).to(tl.float32)
            partial += (a_even * low + a_odd * high) * scale
        acc = tl.sum(tl.sum(partial, axis=1), axis=0)[None, :]
    out = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _e4m3_of_e2m1(code):
    """e2m1 codes (int32, 0..15) -> e4m3 bytes worth value * 2^-6 exactly: the magnitude bits
    shifted up two (exponent e at bits 4..3, mantissa at bit 2: 2^(e - 7) * (1 + m / 2), and the
    subnormal m / 2 * 2^-6 when e = 0), the sign from bit 3 to bit 7."""
    return (((code & 7) << 2) | ((code & 8) << 4)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp4_fp8_kernel(xq_ptr, xs_ptr, codes_ptr, exps_ptr, out_ptr, starts_ptr, ends_ptr, tile_ends_ptr,
                    num_experts, N, K,
                    stride_xm, stride_sm, stride_ce, stride_cn, stride_se, stride_sn, stride_om,
                    GROUP: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_fp4_grouped_kernel's product with e4m3 activations xq (their bytes; scales xs, one per row and QBLOCK
    inputs) on the FP8 tensor cores: one dot per scale group of GROUP inputs, its float32 result
    times the group's weight scales, the QBLOCK's sum times the rows' activation scales."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tile >= tl.load(tile_ends_ptr + num_experts - 1):
        return
    expert, row_start, row_end = _expert_rows(tile, starts_ptr, ends_ptr, tile_ends_ptr, num_experts, BLOCK_M)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    # Input k of a group sits in byte k // 2, low nibble for even k: each byte is loaded for both
    # of its inputs (the second load hits the cache), so the weights come out in input order.
    kk = tl.arange(0, GROUP)
    shift = ((kk % 2) * 4)[:, None]
    code_cols = codes_ptr + expert.to(tl.int64) * stride_ce + cols[None, :].to(tl.int64) * stride_cn
    exp_cols = exps_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_sn
    x_rows = xq_ptr + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, QBLOCK):
        block = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in tl.static_range(QBLOCK // GROUP):
            k = k0 + g * GROUP
            packed = tl.load(code_cols + (k // 2 + kk // 2)[:, None], mask=col_ok[None, :], other=0)
            w = _e4m3_of_e2m1((packed.to(tl.int32) >> shift) & 0xF)                  # [GROUP, BLOCK_N]
            a = tl.load(x_rows + (k + kk)[None, :], mask=row_ok[:, None], other=0)    # [BLOCK_M, GROUP] bytes
            a = a.to(tl.float8e4nv, bitcast=True)
            # 2^(exponent - 127) times 2^6, _e4m3_of_e2m1's factor, made from its float32 bits.
            exps = tl.load(exp_cols + k // GROUP, mask=col_ok, other=127).to(tl.int32)
            scale = ((exps + 6) << 23).to(tl.float32, bitcast=True)
            block += tl.dot(a, w) * scale[None, :]
        x_scale = tl.load(xs_ptr + rows.to(tl.int64) * stride_sm + k0 // QBLOCK, mask=row_ok, other=0.0)
        acc += block * x_scale[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class TileConfig(NamedTuple):
    """One launch's tiling: BLOCK_M rows of one expert share a decoded weight tile of BLOCK_N
    outputs x BLOCK_K inputs (`num_stages`: the K blocks whose loads are in flight at once; for
    the GEMV, 1 loads each block after the last one's sums); `dot`: the product on the tensor
    cores (BLOCK_M >= 16), else one row (BLOCK_M 1) as float32 multiply-adds, a GEMV (batch-1
    decode: every expert one row);
    `fp8`: e4m3 activations on the FP8 tensor cores (_fp4_fp8_kernel; block_k unused: one dot a
    scale group, one activation scale per FP8_QBLOCK inputs); `split_k`: the inputs cut into
    that many runs, each its own program writing float32 partial sums that are then added (more
    programs where a product has few outputs to share out: batch-1 decode's six experts);
    `group_scales` (dots): each group's scale made once and broadcast over its weights, which
    are then reshaped for the dot, instead of an exponent load and conversion per code byte;
    `bf16_ptx` (dots, bfloat16 activations, CUDA): the weights decoded and scaled in bfloat16x2
    PTX (_E2M1_SCALED_BF16_ASM), not in float32 (fewer instructions a weight; not yet the
    default: its products have not yet been checked on a GPU)."""
    block_m: int
    block_n: int
    block_k: int
    dot: bool
    num_warps: int = 4
    num_stages: int = 3
    fp8: bool = False
    split_k: int = 1
    group_scales: bool = False
    bf16_ptx: bool = False


# Inputs sharing an activation scale on the FP8 path: DeepSeek's 1 x 128 activation blocks.
FP8_QBLOCK = 128


def default_config(rows: int, num_experts: int) -> TileConfig:
    """The tiling for `rows` rows over `num_experts` experts, from the shapes alone (a CUDA graph
    replays one launch whatever the routing): by the rows an expert with rows has on average.
    The tiles are the fastest that benchmarks/fp4_moe_tune.py found at V4-Flash's expert shapes
    (docs/benchmarks/design-measurements.md#fp4-expert-tiles)."""
    per_expert = rows / max(1, min(num_experts, rows))
    if per_expert <= 1:      # batch-1 decode: every expert one row
        return TileConfig(1, 64, 256, dot=False, num_warps=4, num_stages=1)
    if per_expert < 64:      # decode batches
        return TileConfig(16, 128, 128, dot=True, num_stages=4, group_scales=True)
    return TileConfig(128, 128, 64, dot=True, num_warps=8)


class ExpertTiles(NamedTuple):
    """Each expert's first and end row and the cumulative count of its BLOCK_M-row tiles."""
    starts: torch.Tensor
    ends: torch.Tensor
    tile_ends: torch.Tensor


def expert_tiles(counts: torch.Tensor, block_m: int) -> ExpertTiles:
    """The tiles of experts with counts[e] rows each (the two products of a MoE layer share them)."""
    counts = counts.to(torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    return ExpertTiles(ends - counts, ends, ((counts + block_m - 1) // block_m).cumsum(0, dtype=torch.int32))


def fp4_grouped_mm(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor, counts: torch.Tensor,
                   config: TileConfig | None = None, tiles: ExpertTiles | None = None,
                   asm: bool | None = None) -> torch.Tensor:
    """x [rows, K] sorted by expert, expert e's rows being counts[e] consecutive ones (counts [E],
    on x's device); codes uint8 [E, N, K/2], exponents uint8 [E, N, K/G] -> [rows, N] in x's dtype.
    config (None: default_config): each program decodes its weight tile once for BLOCK_M rows, so
    many rows an expert (prefill) take tall tiles, few (decode) short ones that waste no rows.
    tiles: expert_tiles(counts, config.block_m), when the caller has them. asm (None: where it
    runs, _asm_decode): decode the codes with the kernel's PTX, else with plain Triton ops (the
    tests compare the two)."""
    rows, k = x.shape
    num_experts, n, packed_k = codes.shape
    group = k // exponents.shape[-1]
    config = config or default_config(rows, num_experts)
    # The K block shrinks to a power of two dividing K (small models' experts); it must still hold
    # whole scale groups.
    config = config._replace(block_k=math.gcd(config.block_k, k))
    if not config.dot and config.block_m != 1:
        raise ValueError(f"fp4_grouped_mm: a tiling without dots takes one row a tile, not {config.block_m}")
    if packed_k * 2 != k or config.block_k % group or config.block_k < 32:
        raise ValueError(f"fp4_grouped_mm: inputs {k} must be twice the codes' {packed_k} and have a "
                         f"power-of-two divisor of at least 32 holding whole scale groups of {group}")
    x = x.contiguous()
    starts, ends, tile_ends = tiles if tiles is not None else expert_tiles(counts, config.block_m)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, config.block_m) + min(num_experts, rows), triton.cdiv(n, config.block_n))
    if config.fp8:
        qblock = math.gcd(FP8_QBLOCK, k)
        if config.block_m < 16 or qblock % group or group < 32:
            raise ValueError(f"fp4_grouped_mm: the FP8 path takes tiles of at least 16 rows and scale groups "
                             f"of at least 32 inputs dividing {qblock}, not {config.block_m} rows, groups of {group}")
        xq, xs = fp8.quantize_rows(x, qblock)
        # The codes as bytes (a masked load of float8 has no `other` to fill with).
        _fp4_fp8_kernel[grid](xq.view(torch.uint8), xs, codes, exponents, out, starts, ends, tile_ends, num_experts, n, k,
                              xq.stride(0), xs.stride(0), codes.stride(0), codes.stride(1), exponents.stride(0),
                              exponents.stride(1), out.stride(0), GROUP=group, QBLOCK=qblock,
                              BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                              num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    # As many runs of K as divide it into whole K blocks (small models' experts take fewer).
    split_k = math.gcd(config.split_k, k // config.block_k)
    target = out if split_k == 1 else torch.empty(split_k, rows, n, dtype=torch.float32, device=x.device)
    _fp4_grouped_kernel[grid + (split_k,)](x, codes, exponents, target, starts, ends, tile_ends, num_experts, n, k,
                                           x.stride(0), codes.stride(0), codes.stride(1), exponents.stride(0),
                                           exponents.stride(1), target.stride(-2), target.stride(0) if split_k > 1 else 0,
                                           GROUP=group, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                                           BLOCK_K=config.block_k, USE_DOT=config.dot, IEEE=x.dtype == torch.float32,
                                           ASM=_asm_decode(x.device) if asm is None else asm, SPLIT_K=split_k,
                                           GROUP_SCALES=config.group_scales, BF16_PTX=config.bf16_ptx,
                                           GEMV_STAGES=config.num_stages,
                                           num_warps=config.num_warps, num_stages=config.num_stages)
    if split_k > 1:
        torch.sum(target, dim=0, out=out)   # float32 partials, summed into the activations' dtype
    return out


def _asm_decode(device: torch.device) -> bool:
    """Whether the kernels decode codes with their PTX (_E2M1_PAIRS_ASM): on NVIDIA GPUs, not
    under Triton's interpreter (which runs no PTX) nor on ROCm."""
    return device.type == "cuda" and torch.version.hip is None and not envs.triton_interpreter()


@triton.jit
def _dequantize_kernel(codes_ptr, exps_ptr, out_ptr, packed_k, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    byte = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = byte < packed_k
    packed = tl.load(codes_ptr + row * packed_k + byte, mask=ok, other=0).to(tl.int32)
    exps = tl.load(exps_ptr + row * (2 * packed_k // GROUP) + byte // (GROUP // 2), mask=ok, other=127)
    scale = _scale(exps)
    kind = out_ptr.dtype.element_ty
    # The two nibbles' values interleaved (input 2p, then 2p + 1) and stored as one contiguous run:
    # two stores at a stride of two elements wrote each cache line half at a time (slower: the
    # measurement under design-measurements.md's FP4 expert tiles).
    values = tl.interleave((_e2m1(packed & 0xF) * scale).to(kind), (_e2m1(packed >> 4) * scale).to(kind))
    out = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + row * 2 * packed_k + out, values, mask=out < 2 * packed_k)


def dequantize(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """fp4.dequantize in one kernel: codes uint8 [..., N, K/2], exponents [..., N, K/G] -> [..., N, K]
    (into `out`, contiguous, when given)."""
    *lead, n, packed_k = codes.shape
    group = 2 * packed_k // exponents.shape[-1]
    if out is None:
        out = torch.empty(*lead, n, 2 * packed_k, dtype=dtype, device=codes.device)
    rows = out.numel() // max(1, 2 * packed_k)
    if rows:
        _dequantize_kernel[(rows, triton.cdiv(packed_k, 1024))](codes.contiguous(), exponents.contiguous(), out,
                                                                packed_k, GROUP=group, BLOCK=1024)
    return out


# Experts dequantized at once for a prefill's grouped product: the scratch a chunk takes (two
# chunks on CUDA, where the next chunk is dequantized while this one is multiplied).
DEQUANTIZED_BYTES = 1 << 30
# On CUDA, dequantize chunk i + 1 on a side stream while chunk i's grouped GEMM runs: the one is
# bound by memory, the other by the tensor cores. False: one after the other (the reference), the
# default until a GPU run has checked the overlapped products and timed the prefill with them.
OVERLAP_DEQUANTIZE = False
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def fp4_grouped_mm_dequantized(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor,
                               counts: torch.Tensor) -> torch.Tensor:
    """fp4_grouped_mm for many rows an expert (a prefill), as bf16 grouped GEMMs on the tensor
    cores: the experts dequantized a chunk of DEQUANTIZED_BYTES at a time (dequantize) and
    multiplied by torch._grouped_mm. The kernel above decodes each weight once per 128-row tile and
    stays far below the tensor cores there (benchmarks/fp4_moe_tune.py); decoding once a product
    costs a write and a read of the bf16 weight instead. Reads the counts on the host: not for
    CUDA graphs (prefill runs eagerly)."""
    num_experts, n, packed_k = codes.shape
    per_expert = n * packed_k * 2 * x.element_size()
    chunk = max(1, DEQUANTIZED_BYTES // per_expert)
    ends = counts.cumsum(0).tolist()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    # The chunks with rows: (first expert, last expert + 1, first row, end row).
    chunks = [(first, min(first + chunk, num_experts), ends[first - 1] if first else 0,
               ends[min(first + chunk, num_experts) - 1]) for first in range(0, num_experts, chunk)]
    chunks = [c for c in chunks if c[3] > c[2]]
    if x.device.type == "cuda" and OVERLAP_DEQUANTIZE and len(chunks) > 1:
        _overlapped_chunks(x, codes, exponents, counts, chunks, chunk, out)
        return out
    for first, last, lo, hi in chunks:
        weights = dequantize(codes[first:last], exponents[first:last], x.dtype)
        offs = counts[first:last].cumsum(0).to(torch.int32)
        out[lo:hi] = torch._grouped_mm(x[lo:hi], weights.transpose(1, 2), offs=offs)
    return out


def _overlapped_chunks(x, codes, exponents, counts, chunks, chunk: int, out: torch.Tensor) -> None:
    """fp4_grouped_mm_dequantized's loop with two scratch buffers: chunk i + 1 is dequantized on a
    side stream while chunk i's GEMM runs on the current one. A buffer is rewritten only after the
    GEMM that read it (an event each way), and the scratch is the current stream's, which waits
    for every dequantization before it reads it, so nothing outlives its use."""
    num_experts, n, packed_k = codes.shape
    main = torch.cuda.current_stream(x.device)
    side = _side_streams.setdefault(x.device, torch.cuda.Stream(x.device))
    scratch = torch.empty(2, min(chunk, num_experts), n, 2 * packed_k, dtype=x.dtype, device=x.device)
    ready: list[torch.cuda.Event | None] = [None, None]
    side.wait_stream(main)   # the scratch (and whatever the main stream queued) before the side writes

    def dequantize_on_side(i: int) -> None:
        first, last = chunks[i][:2]
        with torch.cuda.stream(side):
            dequantize(codes[first:last], exponents[first:last], x.dtype, out=scratch[i % 2, :last - first])
            ready[i % 2] = side.record_event()

    dequantize_on_side(0)
    for i, (first, last, lo, hi) in enumerate(chunks):
        if i + 1 < len(chunks):
            dequantize_on_side(i + 1)   # the other buffer: free since chunk i - 1's GEMM (waited below)
        main.wait_event(ready[i % 2])
        offs = counts[first:last].cumsum(0).to(torch.int32)
        out[lo:hi] = torch._grouped_mm(x[lo:hi], scratch[i % 2, :last - first].transpose(1, 2), offs=offs)
        side.wait_event(main.record_event())   # chunk i + 2 may take this buffer only after this GEMM


def kernel_works(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel compiles on this device and matches the dequantized reference on small
    products in both of default_config's decode tilings (activations in `dtype`, three experts,
    one without rows: a decode batch's dots, then one row an expert, the GEMV): asked once a
    device and dtype, so a Triton that cannot build it, or a tiling that multiplies wrongly, sends
    the experts to the reference loop instead of failing a step or answering wrongly."""
    key = f"{device}:{dtype}"
    if key not in _works:
        try:
            generator = torch.Generator(device=device).manual_seed(0)
            codes, exps = fp4.quantize(torch.randn(3, 64, 128, device=device, generator=generator), 32)
            _works[key] = all(_matches_reference(codes, exps, rows, dtype, generator) for rows in ((12, 0, 8), (1, 0, 1)))
            if not _works[key]:
                logger.warning("the FP4 experts' kernel gave wrong products on %s; FP4 experts are dequantized", device)
        except Exception as e:   # a Triton that cannot compile it: the reference serves
            logger.warning("the FP4 experts' kernel does not run on %s (%s); FP4 experts are dequantized",
                           device, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
            _works[key] = False
    return _works[key]


def _matches_reference(codes: torch.Tensor, exps: torch.Tensor, rows: tuple[int, ...], dtype: torch.dtype,
                       generator: torch.Generator) -> bool:
    """fp4_grouped_mm in its default tiling for experts with `rows` rows each, against F.linear on
    the dequantized weights."""
    device = codes.device
    x = torch.randn(sum(rows), codes.shape[-1] * 2, device=device, generator=generator).to(dtype)
    got = fp4_grouped_mm(x, codes, exps, torch.tensor(rows, device=device)).float()
    starts = [sum(rows[:e]) for e in range(len(rows))]
    want = torch.cat([F.linear(x[start:start + n].float(), fp4.dequantize(codes[e], exps[e]))
                      for e, (start, n) in enumerate(zip(starts, rows)) if n])
    return bool(torch.allclose(got, want, atol=0.5, rtol=0.02))
