// kernelmux cuda backend: W4A16 on the tensor cores (mma.sync; sm_80 on, sm_89 for NVFP4's e4m3 scales): packed
// e2m1 weights decoded in registers into exactly scaled 16-bit pairs, and m16n8k16 MMAs against 16-bit
// activations.
//
// A warp's step is 16 weight rows x 128 of K (kFp4StepK). Lane (g, t) = (lane / 4, lane % 4) holds 16 bytes
// of rows g and g + 8: codes [32 t, 32 t + 32) of the step, one MXFP4 block or two NVFP4 blocks. Each 32-bit
// word of 8 codes becomes four pairs, codes (q, q + 4) for q = 0..3, each code's magnitude bits placed as the
// exponent and top mantissa bits of a 16-bit float (a subnormal for 0.5) and its sign as the sign, so the pair
// is e2m1 * 2^-126 (bf16) or e2m1 * 2^-14 (fp16) exactly (e2m1_pair); one packed multiply by the block's scale
// (times the bias) makes it the weight. The MMA's K order is the pairs': the activations are
// permuted to match (x_pairs), so each MMA's operands are the lane's own registers and nothing is exchanged.
// The B operand's eight columns are eight activation rows; one row (a GEMV) fills all eight with it.
// _toolchain.py hands every kernels/*.cuh to NVRTC, so a kernel includes it by name.

#pragma once

#include "common.cuh"

namespace {

constexpr int kFp4StepK = 128;  // K of a warp step: 4 lanes x 32 codes
// NVFP4's block scale is multiplied into the weights as sf * 2^118 (bf16: finite for sf <= 448) or sf * 2^7
// (fp16: at most 57344): the weights are then e2m1 * sf * 2^-8 or 2^-7, every product exact and none below the
// format's normal range, and the fp32 sums are scaled back by kNvfp4Unbias.
template <bool BF16> constexpr float kNvfp4Unbias = BF16 ? 256.0f : 128.0f;

// Codes q and q + 4 of the 8 in v (code i in bits 4i..4i+3) as a 16-bit pair, code q in the low half:
// e2m1 * 2^-126 (bf16) or e2m1 * 2^-14 (fp16), exact.
template <bool BF16, int Q>
__device__ __forceinline__ u32 e2m1_pair(u32 v) {
    if constexpr (BF16) {
        // The two codes masked at bits 0..3 (q even) or 4..7 (odd) of each half, then one multiply adds two
        // copies that do not overlap: shifted by 6 or 2 (the magnitude to bits 6..8) and by 12 or 8 (the sign to
        // bit 15). 13 instructions a word against 15 for a shift and two masks a pair (H200: 35.4 against 36.3 us).
        const u32 codes = (Q < 2 ? v : v >> 8) & (Q & 1 ? 0x00f000f0u : 0x000f000fu);
        return (codes * (Q & 1 ? 0x104u : 0x1040u)) & 0x81c081c0u;
    } else {  // fp16's magnitude bits (9..11) sit too near the sign for two copies
        const u32 u = v << (4 * (3 - Q));  // codes q and q + 4 to bits 12..15 and 28..31: their signs in place
        return (u & 0x80008000u) | ((u >> 3) & 0x0e000e00u);
    }
}

// a * b on 16-bit pairs (as an fma with -0, which leaves every product, -0 included, as it is).
template <bool BF16>
__device__ __forceinline__ u32 mul2(u32 a, u32 b) {
    u32 d;
    if constexpr (BF16) {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    } else {
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    }
    return d;
}

__device__ __forceinline__ u32 both_halves(u32 h) { return h | (h << 16); }

// The scale code(s) of a lane's 32 codes at element k of a row whose scales start at `row`: one e8m0 byte, or
// NVFP4's two e4m3 bytes (the first block low).
template <bool NVFP4>
__device__ __forceinline__ u32 load_scales(const unsigned char* row, int k, i64 stride_k) {
    if constexpr (NVFP4) {
        const i64 block = k / 16;
        return (u32)row[block * stride_k] | (u32)row[(block + 1) * stride_k] << 8;
    } else {
        return row[(i64)(k / 32) * stride_k];
    }
}

// The same from a pointer to the lane's first scale (`stride_k` apart).
template <bool NVFP4>
__device__ __forceinline__ u32 load_lane_scales(const unsigned char* p, i64 stride_k) {
    if constexpr (NVFP4) {
        return (u32)p[0] | (u32)p[stride_k] << 8;
    } else {
        return p[0];
    }
}

// One row's 16 bytes of codes (4 words) as 16 weight pairs p[4 w + q] = codes (8 w + q, 8 w + q + 4), scaled:
// MXFP4 (`scales`: its e8m0 code; bf16 only): e2m1 * 2^(code - 127), exact, NaN for code 0xFF; NVFP4 (`scales`:
// two e4m3 codes, words 0-1's block in the low byte): e2m1 * sf / kNvfp4Unbias, exact.
template <bool BF16, bool NVFP4>
__device__ __forceinline__ void decode_row(uint4 codes, u32 scales, u32 (&p)[16]) {
    const u32 words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        p[4 * w + 0] = e2m1_pair<BF16, 0>(words[w]);
        p[4 * w + 1] = e2m1_pair<BF16, 1>(words[w]);
        p[4 * w + 2] = e2m1_pair<BF16, 2>(words[w]);
        p[4 * w + 3] = e2m1_pair<BF16, 3>(words[w]);
    }
    if constexpr (NVFP4) {
        u32 s[2];
        const u32 sf = cvt_e4m3x2_f16x2(scales);
        if constexpr (BF16) {
            float lo, hi;
            unpack2<false>(sf, lo, hi);
            constexpr float bias = (float)(1ull << 59) * (float)(1ull << 59);  // 2^118
            s[0] = both_halves(pack2<true>(lo * bias, 0.0f));
            s[1] = both_halves(pack2<true>(hi * bias, 0.0f));
        } else {
            const u32 scaled = mul2<false>(sf, 0x58005800u);  // times 2^7 (f16 0x5800)
            s[0] = both_halves(scaled & 0xffffu);
            s[1] = scaled & 0xffff0000u | (scaled >> 16);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) p[i] = mul2<BF16>(p[i], s[i / 8]);
    } else {
        static_assert(BF16, "MXFP4 with fp16 activations: e8m0 scales leave fp16's range");
        const u32 code = scales & 0xffu;
        if (code <= 128) {  // 2^(code - 1) is a bf16 (real checkpoints' scales are all here)
#pragma unroll
            for (int i = 0; i < 16; ++i) p[i] = mul2<true>(p[i], both_halves((code + 126) << 7));
        } else {  // two steps: 2^126, then 2^(code - 127) (0xFF: NaN, as the reference's block)
            const u32 second = both_halves(code == 0xffu ? 0x7fc0u : code << 7);
#pragma unroll
            for (int i = 0; i < 16; ++i) p[i] = mul2<true>(mul2<true>(p[i], 0x7e807e80u), second);
        }
    }
}

// The lane's 32 activations of a step (x[0..3]: its 64 bytes in K order) as the pairs decode_row's weights
// pair with: xp[4 w + q] = (x[8 w + q], x[8 w + q + 4]).
__device__ __forceinline__ void x_pairs(const uint4 (&x)[4], u32 (&xp)[16]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 v[4] = {x[i].x, x[i].y, x[i].z, x[i].w};  // (x0, x1), (x2, x3), (x4, x5), (x6, x7)
        xp[4 * i + 0] = __byte_perm(v[0], v[2], 0x5410);
        xp[4 * i + 1] = __byte_perm(v[0], v[2], 0x7632);
        xp[4 * i + 2] = __byte_perm(v[1], v[3], 0x5410);
        xp[4 * i + 3] = __byte_perm(v[1], v[3], 0x7632);
    }
}

// d += A (16 x 16, row-major fragment a0..a3) . B (16 x 8, b0, b1), fp32 accumulation.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// d += the decoded rows (a: row g's pairs, b: row g + 8's; decode_row's) . 8 activation rows, lane (g, t)
// giving row g's 32 activations of its codes in K order (x): d[0], d[1] are row g's sums against activation
// rows 2 t and 2 t + 1, d[2], d[3] row g + 8's.
template <bool BF16>
__device__ __forceinline__ void fp4_mmas(const u32 (&a)[16], const u32 (&b)[16], const uint4 (&x)[4], float (&d)[4]) {
    u32 xp[16];
    x_pairs(x, xp);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        mma_16816<BF16>(d, a[2 * j], b[2 * j], a[2 * j + 1], b[2 * j + 1], xp[2 * j], xp[2 * j + 1]);
    }
}

// The lane's 32 activations of a step (at x_offset bytes into each group's row, 16-byte aligned) against the
// step's decoded rows (g, g + 8), for each group of 8 activation rows.
template <bool BF16, int GROUPS>
__device__ __forceinline__ void fp4_gemv_groups(const u32 (&da)[16], const u32 (&db)[16],
                                                const unsigned char* const (&x_rows)[GROUPS], i64 x_offset, bool in_k,
                                                int groups, float (&d)[GROUPS][4]) {
#pragma unroll
    for (int j = 0; j < GROUPS; ++j) {
        if (j >= groups) break;  // warp-uniform
        uint4 x[4] = {};
        if (in_k) {
            const uint4* xs = reinterpret_cast<const uint4*>(x_rows[j] + x_offset);
#pragma unroll
            for (int i = 0; i < 4; ++i) x[i] = xs[i];
        }
        fp4_mmas<BF16>(da, db, x, d[j]);
    }
}

// UNROLL steps of a warp's GEMV over two weight rows (the MMA's rows g and g + 8), steps first, first + STRIDE, ...
// of K: every step's loads, then each step's decoding and MMAs against each group of 8 activation rows. The row,
// scale and activation pointers are the lane's at step 0 (its 16 bytes of codes, its scales `scale_stride_k`
// apart, its 64 bytes of activations); a step moves them by 64 bytes, `step_scales` and 256 bytes. TAIL: the
// warp's last batch, whose steps may end at `steps` or lie partly past K (codes zero there, nothing read);
// otherwise every step lies within K and nothing is guarded.
template <int STRIDE, int UNROLL, bool BF16, bool NVFP4, bool TAIL, int GROUPS>
__device__ __forceinline__ void fp4_gemv_batch(int first, int steps, int k, int t, const unsigned char* row_g,
                                               const unsigned char* row_g8, const unsigned char* scales_g,
                                               const unsigned char* scales_g8, i64 step_scales, i64 scale_stride_k,
                                               const unsigned char* const (&x_rows)[GROUPS], int groups,
                                               float (&d)[GROUPS][4]) {
    constexpr int kStepBytes = kFp4StepK / 2;
    uint4 w_g[UNROLL], w_g8[UNROLL];
    u32 s_g[UNROLL], s_g8[UNROLL];
    bool in_k[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int step = first + u * STRIDE;
        // K is a multiple of 32: a lane's 32 codes lie all within K or all past it.
        in_k[u] = !TAIL || (step < steps && step * kFp4StepK + 32 * t < k);
        w_g[u] = w_g8[u] = make_uint4(0, 0, 0, 0);
        s_g[u] = s_g8[u] = 0;
        if (in_k[u]) {
            w_g[u] = stream_load(row_g + (i64)step * kStepBytes);
            w_g8[u] = stream_load(row_g8 + (i64)step * kStepBytes);
            s_g[u] = load_lane_scales<NVFP4>(scales_g + step * step_scales, scale_stride_k);
            s_g8[u] = load_lane_scales<NVFP4>(scales_g8 + step * step_scales, scale_stride_k);
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int step = first + u * STRIDE;
        if (TAIL && step >= steps) break;  // warp-uniform
        u32 da[16], db[16];
        decode_row<BF16, NVFP4>(w_g[u], s_g[u], da);
        decode_row<BF16, NVFP4>(w_g8[u], s_g8[u], db);
        fp4_gemv_groups<BF16, GROUPS>(da, db, x_rows, (i64)step * kFp4StepK * 2, in_k[u], groups, d);
    }
}

// One step of a warp's GEMV: d += rows (g, g + 8) of the step's weights . the activations, where `rows` are the
// lane's 16 bytes of each row with their scales (decode_row's), and x its 32 activations in K order. With one
// activation row in every B column, every lane's d[0] (= d[1]) is row g's sum and d[2] (= d[3]) row g + 8's.
template <bool BF16, bool NVFP4>
__device__ __forceinline__ void fp4_gemv_step(uint4 row_g, uint4 row_g8, u32 scale_g, u32 scale_g8,
                                              const uint4 (&x)[4], float (&d)[4]) {
    u32 a[16], b[16];
    decode_row<BF16, NVFP4>(row_g, scale_g, a);
    decode_row<BF16, NVFP4>(row_g8, scale_g8, b);
    fp4_mmas<BF16>(a, b, x, d);
}

}  // namespace
