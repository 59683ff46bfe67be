// kernelmux cuda backend: what the quantizing kernels share (quantize_fp8.cu, quantize_fp4.cu, and the fp8 epilogue
// of fused_moe_sm90.cu): the input kinds and their 16-byte vectors, |x| maxima on the input's own bits (non-negative
// floats order as unsigned integers), the folded maximum as the fp32 value it is, a slot's maxima over a warp's
// lanes, per-CTA maxima reduced, a CTA's maximum, and quantize_fp8's scales, quotients and e4m3 codes.

#pragma once

#include "common.cuh"

namespace {

// Input kinds (the host's KINDS): bf16, fp16, fp32. A 16-byte vector holds kVec<KIND> elements.
constexpr int kBf16 = 0, kFp16 = 1, kFp32 = 2;
template <int KIND> constexpr int kVec = KIND == kFp32 ? 4 : 8;

// The running maximum of |x| over a vector, as magnitude bits: for 16-bit inputs two 16-bit maxima in one
// word (max.u16x2, one instruction for two elements), for fp32 one.
__device__ __forceinline__ u32 max_u16x2(u32 a, u32 b) {
    u32 d;
#if __CUDA_ARCH__ >= 900
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
    d = __vmaxu2(a, b);
#endif
    return d;
}

template <int KIND>
__device__ __forceinline__ u32 magnitude_max(const uint4& v, u32 m) {
    if constexpr (KIND == kFp32) {
        m = max(m, max(v.x & 0x7fffffffu, v.y & 0x7fffffffu));
        return max(m, max(v.z & 0x7fffffffu, v.w & 0x7fffffffu));
    } else {
        m = max_u16x2(m, max_u16x2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu));
        return max_u16x2(m, max_u16x2(v.z & 0x7fff7fffu, v.w & 0x7fff7fffu));
    }
}

// magnitude_max's word as one magnitude (the larger half for 16-bit inputs), ordered as an unsigned int.
template <int KIND>
__device__ __forceinline__ u32 fold(u32 m) {
    if constexpr (KIND == kFp32) {
        return m;
    } else {
        return max(m & 0xffffu, m >> 16);
    }
}

// A folded magnitude as the fp32 value it is (exact).
template <int KIND>
__device__ __forceinline__ float magnitude_value(u32 m) {
    if constexpr (KIND == kBf16) {
        return __uint_as_float(m << 16);
    } else if constexpr (KIND == kFp16) {
        float lo, hi;
        unpack2<false>(m, lo, hi);
        return lo;
    } else {
        return __uint_as_float(m);
    }
}

// The maxima of |x| over each slot's group or block of LANES lanes (xor shuffles), every lane of it getting them:
// for 16-bit inputs two slots' maxima in one shuffled word (max.u16x2) where SLOTS is even.
template <int KIND, int LANES, int SLOTS>
__device__ __forceinline__ void slot_maxima(const uint4 (&v)[SLOTS], u32 (&m)[SLOTS]) {
    constexpr bool kPaired = KIND != kFp32 && SLOTS % 2 == 0;
    if constexpr (kPaired) {
#pragma unroll
        for (int s = 0; s < SLOTS; s += 2) {
            const u32 a = magnitude_max<KIND>(v[s], 0), b = magnitude_max<KIND>(v[s + 1], 0);
            u32 both = max_u16x2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));  // slot s low, s + 1 high
#pragma unroll
            for (int offset = LANES / 2; offset > 0; offset >>= 1)
                both = max_u16x2(both, __shfl_xor_sync(0xffffffffu, both, offset));
            m[s] = both & 0xffffu;
            m[s + 1] = both >> 16;
        }
    } else {
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            m[s] = fold<KIND>(magnitude_max<KIND>(v[s], 0));
#pragma unroll
            for (int offset = LANES / 2; offset > 0; offset >>= 1)
                m[s] = max(m[s], __shfl_xor_sync(0xffffffffu, m[s], offset));
        }
    }
}

// This thread's share of the largest of `count` per-CTA maxima (non-negative fp32, as bits: they order as unsigned
// integers), `threads` apart; kPartialLoads loads a thread in flight, since the maxima sit in L2. cta_max then
// gives the CTA's.
constexpr int kPartialLoads = 8;
__device__ __forceinline__ u32 partials_max(const float* __restrict__ partials, int count, int threads) {
    u32 m = 0;
    for (int i = threadIdx.x; i < count; i += kPartialLoads * threads) {
        u32 got[kPartialLoads];
#pragma unroll
        for (int j = 0; j < kPartialLoads; ++j) {
            got[j] = i + j * threads < count ? __float_as_uint(partials[i + j * threads]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < kPartialLoads; ++j) m = max(m, got[j]);
    }
    return m;
}

// The maximum of every thread's u32 in the CTA, returned to every thread (one barrier; shared memory is free
// again once it returns only after the caller's next barrier, so a CTA calls it once).
__device__ __forceinline__ u32 cta_max(u32 m) {
    __shared__ u32 warp_max[32];
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = max(m, warp_max[w]);
    return m;
}

// quantize_fp8's arithmetic (quantize_fp8.cu's header says why each step is there): e4m3fn's range, the spec's
// floors, scales, divisors, quotients and codes.
constexpr float kFp8Max = 448.0f;
constexpr float kGroupAmaxFloor = 1e-4f;     // per_group floors the amax (the spec's GROUP_AMAX_FLOOR)
constexpr float kScaleFloor = 0x1p-126f;     // per_token / per_tensor floor the scale (2^-126)
constexpr float kRescaleBelow = 0x1p-100f;   // row scales below this divide a rescaled row (see divisor)
constexpr float kRescale = 0x1p64f;

// The spec's scale: max(amax, 1e-4) / 448 for groups, else max(amax / 448, 2^-126), IEEE divisions; ue8m0
// rounds it up to a power of two on the bits (a mantissa that is not zero carries into the exponent).
template <bool GROUPED, bool UE8M0>
__device__ __forceinline__ float scale_of(float amax) {
    float s = GROUPED ? __fdiv_rn(fmaxf(amax, kGroupAmaxFloor), kFp8Max) : fmaxf(__fdiv_rn(amax, kFp8Max), kScaleFloor);
    if constexpr (UE8M0) s = __uint_as_float((__float_as_uint(s) + 0x7fffffu) & 0xff800000u);
    return s;
}

// What each quotient x / scale needs: the (rescaled) scale, its correctly rounded reciprocal and the factor
// x is multiplied by first. A power of two's reciprocal is exact, from the exponent bits (scales are normal:
// 2^-126 up to 2^120, so 1 / s is too). Other scales below kRescaleBelow (rows only: groups' are >= 1e-4 /
// 448) are rescaled with their row by 2^64 (exact), so the FMA residual of any quotient the codes can tell
// apart stays above fp32's subnormals.
struct Divisor {
    float scale, reciprocal, factor;
};

template <bool UE8M0, bool GROUPED>
__device__ __forceinline__ Divisor divisor(float s) {
    if constexpr (UE8M0) {
        return {s, __uint_as_float((254u << 23) - (__float_as_uint(s) & 0x7f800000u)), 1.0f};
    } else if constexpr (GROUPED) {
        return {s, __frcp_rn(s), 1.0f};
    } else {
        const float factor = s < kRescaleBelow ? kRescale : 1.0f;
        const float scaled = __fmul_rn(s, factor);
        return {scaled, __frcp_rn(scaled), factor};
    }
}

// x / scale, correctly rounded, but for the sign of a zero quotient (codes() puts x's sign bit on the codes).
// POW2: x * (1 / 2^k) is exact: the quotient itself. Else Markstein's correction of x * r by the exact residual
// x - q s (an FMA): where it cancels the product to +0 the IEEE quotient of a negative x is -0, hence the sign
// copied from x. RESCALE: x times the divisor's factor first (exact, sign kept).
template <bool POW2, bool RESCALE>
__device__ __forceinline__ float quotient(float x, const Divisor& d) {
    if constexpr (POW2) {
        return __fmul_rn(x, d.reciprocal);
    } else {
        if constexpr (RESCALE) x = __fmul_rn(x, d.factor);
        const float q = __fmul_rn(x, d.reciprocal);
        return __fmaf_rn(-__fmaf_rn(q, d.scale, -x), d.reciprocal, q);
    }
}

// Two quotients as e4m3fn codes, lo in the low byte: round to nearest even, saturating.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

}  // namespace
