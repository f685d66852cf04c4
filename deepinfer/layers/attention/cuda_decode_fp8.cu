// Paged decode attention over an fp8 (e4m3) KV cache, for a 16-bit q and head_dim 128: one warp
// per (sequence, KV head, split), tensor-core products from registers, no header needed.
// Compiled at run time by NVRTC (deepinfer/platforms/nvrtc.py); the Python side, the layout and
// the reasons are in cuda_decode.py. Compile-time values come as -D macros:
//   GROUP       query heads per KV head, 1..8
//   BLOCK_SIZE  tokens per cache block (a power of two)
//   Q_BF16      1: q and out are bfloat16; 0: float16
//   STAGES      units of 32 keys in each warp's cp.async pipeline (its depth)
//
// The products are mma.sync m16n8k16 with float16 operands and float32 accumulators:
//   scores S[head][key]   = q[head][:] . K[key][:]      A = q (rows: the GROUP heads, zero-padded
//                                                        to 16), B = K^T, straight from shared memory
//   output O^T[dim][head] = sum_key V^T[dim][key] P[head][key]
//                                                        A = V^T, B = P^T: the scores' accumulator
//                                                        registers are already P^T's B fragment
// Because a dot product does not depend on the order of its terms, each thread's share of the
// head dimension is chosen so that its operands are whole 16-byte runs of a key's row: the k index
// of the products (and the row index of O^T) is a permutation of the dimension, undone at store.
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4):
//   A: a0 (row g, cols 2t..2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8..), a3 (row g+8, ..)
//   B: b0 (rows 2t..2t+1, col g), b1 (rows 2t+8..2t+9, col g)
//   C: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define HEAD_DIM 128
#define UNIT 32                  // keys per pipeline stage: one per lane when computing addresses
#define ROW 128                  // bytes of one key's K (or V) in fp8
#define STAGE_BYTES (2 * UNIT * ROW)
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)   // no math header under NVRTC

struct alignas(16) u32x4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two_bytes) {
    u32 out;
    u16 in = (u16)two_bytes;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
    return out;
}

// Base-2 exponential and logarithm: the hardware's approximations (2 ulp), as Triton's exp uses.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 out;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ u32 pack_out16x2(float lo, float hi) {
    u32 out;
#if Q_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
#endif
    return out;
}

__device__ __forceinline__ float q_value(u16 bits) {
#if Q_BF16
    float x = __uint_as_float(((u32)bits) << 16);
#else
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
#endif
    return fminf(fmaxf(x, -65504.0f), 65504.0f);   // the products run in float16
}

__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without registers; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void copy16_async(u32 dst, const u8* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ u32x4 load_shared16(const u8* p) {
    return *reinterpret_cast<const u32x4*>(p);
}

// A key's row in shared memory is 8 chunks of 16 bytes, stored at chunk ^ (key % 8) so that the
// fragment loads of 8 lanes at a time hit 8 different bank groups.
__device__ __forceinline__ int swizzled(int key, int chunk) {
    return key * ROW + ((chunk ^ (key & 7)) << 4);
}

extern "C" __global__ void __launch_bounds__(32) decode_fp8(
    const u16* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    float* __restrict__ o_part, float* __restrict__ lse_part, u16* __restrict__ out,
    float scale_log2, int window, int num_kv_heads, int num_splits,
    i64 stride_qb, i64 stride_qh, i64 stride_kr, i64 stride_kh, i64 stride_vr, i64 stride_vh,
    i64 stride_bt, i64 stride_ob, i64 stride_oh, i64 stride_os, i64 stride_lb, i64 stride_lh,
    i64 stride_outb, i64 stride_outh)
{
    __shared__ __align__(128) u8 smem[STAGES * STAGE_BYTES];
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    int item = blockIdx.x;
    const int split = item % num_splits;
    item /= num_splits;
    const int kv_head = item % num_kv_heads;
    const int seq = item / num_kv_heads;

    // This split's keys [start, end): whole units of [lo, seq_len), as the Triton kernel splits.
    const int seq_len = seq_lens[seq];
    const int lo = window > 0 ? max(seq_len - window, 0) : 0;
    const int units = seq_len > lo ? (seq_len - lo + UNIT - 1) / UNIT : 0;
    const int per_split = (units + num_splits - 1) / num_splits;
    const int start = lo + split * per_split * UNIT;
    const int end = min(start + per_split * UNIT, seq_len);
    const int n_units = start < end ? (end - start + UNIT - 1) / UNIT : 0;

    // q as A fragments: row g is head kv_head * GROUP + g (zero past GROUP; rows g+8 are zero).
    // k index 2t+{0,1} of k-step s is dim 32t+4s+{0,1}; 2t+8+{0,1} is dim 32t+4s+{2,3}.
    u32 qa[8][2];
    {
        float x[32];
        if (g < GROUP) {
            const u32x4* src = reinterpret_cast<const u32x4*>(
                q + seq * stride_qb + (kv_head * GROUP + g) * stride_qh + 32 * t);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32x4 w = src[i];
                u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    x[8 * i + 2 * j] = q_value((u16)(words[j] & 0xffff));
                    x[8 * i + 2 * j + 1] = q_value((u16)(words[j] >> 16));
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) x[i] = 0.0f;
        }
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            qa[s][0] = pack_f16x2(x[4 * s], x[4 * s + 1]);
            qa[s][1] = pack_f16x2(x[4 * s + 2], x[4 * s + 3]);
        }
    }

    const u8* k_base = k_cache + kv_head * stride_kh + (lane & 7) * 16;
    const u8* v_base = v_cache + kv_head * stride_vh + (lane & 7) * 16;
    const int* table = block_table + seq * stride_bt;
    const u32 smem_base = shared_address(smem);

    // The cache row of key `lane` of unit u, or -1 past the split's end.
    auto key_row = [&](int u) -> int {
        const int pos = start + u * UNIT + lane;
        if (u >= n_units || pos >= end) return -1;
        return table[pos / BLOCK_SIZE] * BLOCK_SIZE + (pos & (BLOCK_SIZE - 1));
    };
    // Unit u's K and V into stage u % STAGES: 32 keys x 8 chunks each, 8 + 8 copies per lane.
    auto issue = [&](int u, int row_of_lane) {
        const u32 stage = smem_base + (u % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int key = (lane >> 3) + 4 * i;
            const int row = __shfl_sync(FULL, row_of_lane, key);
            const bool valid = row >= 0;
            const i64 r = valid ? row : 0;
            const u32 dst = stage + swizzled(key, lane & 7);
            copy16_async(dst, k_base + r * stride_kr, valid);
            copy16_async(dst + UNIT * ROW, v_base + r * stride_vr, valid);
        }
    };

#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) {
        issue(u, key_row(u));
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    int row_ahead = key_row(STAGES - 1);   // its table entry is read one unit before it is needed

    float m = NEG_INF, l = 0.0f;         // running max (log2 units) and partial sum, head g
    float acc[8][4];                       // O^T: m-tile i, rows dims, cols heads 2t, 2t+1
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int u = 0; u < n_units; ++u) {
        const int row_issue = row_ahead;
        row_ahead = key_row(u + STAGES);
        if (u + STAGES - 1 < n_units) issue(u + STAGES - 1, row_issue);   // the unit STAGES-1 ahead
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
        __syncwarp();
        const u8* sk = smem + (u % STAGES) * STAGE_BYTES;
        const u8* sv = sk + UNIT * ROW;

        // S for keys 8j + (2t, 2t+1), head g, j = 0..3.
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // dims 32t + 16h .. +16 of key 8j + g: k-steps 4h .. 4h+3
                u32x4 w = load_shared16(sk + swizzled(8 * j + g, 2 * t + h));
                u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int k_step = 4 * h + i;
                    mma_16816(s[j], qa[k_step][0], 0u, qa[k_step][1], 0u,
                              e4m3x2_to_f16x2(words[i]), e4m3x2_to_f16x2(words[i] >> 16));
                }
            }
        }

        // Online softmax in base 2. Keys past `end` score -inf.
        const int first = start + u * UNIT + 2 * t;
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float x = first + 8 * j + c < end ? s[j][c] * scale_log2 : NEG_INF;
                s[j][c] = x;
                mx = fmaxf(mx, x);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
        const float m_new = fmaxf(m, mx);   // finite: every unit holds a key before `end`
        const float alpha = fast_exp2(m - m_new);
        u32 p[4];
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p0 = fast_exp2(s[j][0] - m_new), p1 = fast_exp2(s[j][1] - m_new);
            sum += p0 + p1;
            p[j] = pack_f16x2(p0, p1);
        }
        l = l * alpha + sum;
        m = m_new;
        const float alpha_lo = __shfl_sync(FULL, alpha, 8 * t);      // head 2t lives in lanes 8t..8t+3
        const float alpha_hi = __shfl_sync(FULL, alpha, 8 * t + 4);  // head 2t+1
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[i][0] *= alpha_lo; acc[i][1] *= alpha_hi;
            acc[i][2] *= alpha_lo; acc[i][3] *= alpha_hi;
        }

        // O^T += V^T P^T over k-steps of 16 keys: keys 16kk + (2t, 2t+1, 2t+8, 2t+9), dims
        // 16g .. 16g+15 of each; m-tile i row g is dim 16g + 2i, row g+8 is dim 16g + 2i + 1.
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const int k0 = 16 * kk + 2 * t;
            const u32x4 x0 = load_shared16(sv + swizzled(k0, g));
            const u32x4 x1 = load_shared16(sv + swizzled(k0 + 1, g));
            const u32x4 y0 = load_shared16(sv + swizzled(k0 + 8, g));
            const u32x4 y1 = load_shared16(sv + swizzled(k0 + 9, g));
            const u32 xs0[4] = {x0.x, x0.y, x0.z, x0.w}, xs1[4] = {x1.x, x1.y, x1.z, x1.w};
            const u32 ys0[4] = {y0.x, y0.y, y0.z, y0.w}, ys1[4] = {y1.x, y1.y, y1.z, y1.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                // bytes b of keys (k0, k0+1) side by side: [k0.b, k0+1.b, ...] for b = 0,1 and 2,3
                const u32 xa = __byte_perm(xs0[w], xs1[w], 0x5140), xb = __byte_perm(xs0[w], xs1[w], 0x7362);
                const u32 ya = __byte_perm(ys0[w], ys1[w], 0x5140), yb = __byte_perm(ys0[w], ys1[w], 0x7362);
                mma_16816(acc[2 * w], e4m3x2_to_f16x2(xa), e4m3x2_to_f16x2(xa >> 16),
                          e4m3x2_to_f16x2(ya), e4m3x2_to_f16x2(ya >> 16), p[2 * kk], p[2 * kk + 1]);
                mma_16816(acc[2 * w + 1], e4m3x2_to_f16x2(xb), e4m3x2_to_f16x2(xb >> 16),
                          e4m3x2_to_f16x2(yb), e4m3x2_to_f16x2(yb >> 16), p[2 * kk], p[2 * kk + 1]);
            }
        }
        __syncwarp();   // every lane is done with this stage before the next issue refills it
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // Finish: the sum over the four lanes of head g, then heads 2t and 2t+1 in this lane's columns.
    l += __shfl_xor_sync(FULL, l, 1);
    l += __shfl_xor_sync(FULL, l, 2);
    const float l_h[2] = {__shfl_sync(FULL, l, 8 * t), __shfl_sync(FULL, l, 8 * t + 4)};
    const float m_h[2] = {__shfl_sync(FULL, m, 8 * t), __shfl_sync(FULL, m, 8 * t + 4)};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int head_in_group = 2 * t + c;
        if (head_in_group >= GROUP) continue;
        const int head = kv_head * GROUP + head_in_group;
        const float inv = l_h[c] > 0.0f ? 1.0f / l_h[c] : 0.0f;   // an empty split: zeros
        float vals[16];   // dims 16g .. 16g+15
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            vals[2 * i] = acc[i][c] * inv;
            vals[2 * i + 1] = acc[i][c + 2] * inv;
        }
        if (num_splits == 1) {
            u32x4* dst = reinterpret_cast<u32x4*>(out + seq * stride_outb + head * stride_outh + 16 * g);
            dst[0] = u32x4{pack_out16x2(vals[0], vals[1]), pack_out16x2(vals[2], vals[3]),
                           pack_out16x2(vals[4], vals[5]), pack_out16x2(vals[6], vals[7])};
            dst[1] = u32x4{pack_out16x2(vals[8], vals[9]), pack_out16x2(vals[10], vals[11]),
                           pack_out16x2(vals[12], vals[13]), pack_out16x2(vals[14], vals[15])};
        } else {
            float* dst = o_part + seq * stride_ob + head * stride_oh + split * stride_os + 16 * g;
#pragma unroll
            for (int i = 0; i < 16; ++i) dst[i] = vals[i];
            if (g == 0) {   // natural-log LSE, as the merge kernel reads it
                lse_part[seq * stride_lb + head * stride_lh + split] =
                    l_h[c] > 0.0f ? (m_h[c] + fast_log2(l_h[c])) * 0.6931471805599453f : NEG_INF;
            }
        }
    }
}
