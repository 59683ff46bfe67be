// kernelmux cuda backend: what the quantize kernels share (quantize_fp8.cu, quantize_fp4.cu): the input kinds
// and their 16-byte vectors, |x| maxima on the input's own bits (non-negative floats order as unsigned integers),
// the folded maximum as the fp32 value it is, a slot's maxima over a warp's lanes, per-CTA maxima reduced, and a
// CTA's maximum.

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

}  // namespace
