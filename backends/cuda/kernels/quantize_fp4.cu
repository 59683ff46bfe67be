// kernelmux cuda backend: quantize_nvfp4's and quantize_mxfp4's kernel (e2m1 codes in blocks of 16 with e4m3fn
// scales under an fp32 global scale, or in blocks of 32 with e8m0 scales; sm_89+ for the e4m3 cvt, registered
// for Hopper, where it is measured). Host side: _quantize_fp4.py.
//
// The triton backend's kernels stop at 28-54% of the copy rate on an H200, issue-bound at ~20 SASS instructions
// an element. This one keeps the spec's arithmetic bit for bit and spends about half of that:
//   - warp tasks as quantize_fp8's per_group (quantize_groups): a 16-byte vector a lane, LANES lanes a block,
//     SLOTS vectors a thread in flight; block maxima on the input's bits (max.u16x2), two slots' maxima in one
//     shuffled word; member s of a block's lanes computes the scales of slots s, s + LANES, ... and shuffles
//     the factor r (0 for a block whose codes are all 0) to the others;
//   - NVFP4: sf = e4m3fn(min((gs * amax) / 6, 448)) (IEEE division; cvt.rn.satfinite saturates at 448),
//     r = gs / sf by IEEE division, codes e2m1(x * r); MXFP4: e from the amax's fp32 bits (floor) or from
//     amax / 6's (ceil), r = 2^-e exactly, so x * r is the reference's x / 2^e;
//   - the e2m1 encoder (e2m1_magnitude): m = min(|y|, 6), its binade 2^e (e >= 0) and the magnitude code
//     RN(m 2^(1-e)) + 2e by one FFMA onto 2^23 (round to nearest even at the right place) and one add of
//     the exponent bits: 5 instructions an element, exact in the low byte; the codes of a vector are then
//     paired into bytes, gathered by byte permutes, and the signs of x (the sign of x * r: r > 0) laid on
//     bits 4k + 3 of the word from the inputs' own sign bytes;
//   - a warp writes each slot's codes as 128 contiguous bytes (4 a lane for 16-bit inputs), scales as bytes
//     at their linear or swizzled (128x4) offsets; the host zeroes the swizzled layout's padding.
// NVFP4's dynamic global scale reads the per-CTA maxima quantize_fp8's quantize_rows<KIND, false, kAmax, V>
// left in a workspace (a launch before this one): each CTA reduces them, CTA 0 stores gs.

#include "quantize_common.cuh"

namespace {

// The formats (the host's FORMATS): NVFP4 with a passed-in or a dynamic global scale, MXFP4 floor or ceil.
constexpr int kNvfp4Given = 0, kNvfp4Dynamic = 1, kMxfp4Floor = 2, kMxfp4Ceil = 3;
template <int FORMAT> constexpr int kBlock = FORMAT <= kNvfp4Dynamic ? 16 : 32;
constexpr int kWarps = 4;  // a CTA's warps (the host's THREADS)
// CTAs an SM must hold (the launch bounds): 48 warps in 40 registers without spills. Unbounded, ptxas gave NVFP4 43
// registers (40 warps) and MXFP4 32, issuing its 4th slot's load after the first maxima (perf/decisions/
// quantize_mxfp4.md).
constexpr int kMinCtas = 12;
constexpr float kGlobalNumerator = 2688.0f;  // 448 * 6: the dynamic gs = 2688 / amax(x)

// The e2m1 magnitude code (0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6) of |y|, rounded half to even and saturated at 6,
// in the low byte (bits 8 up are not zero). With m = min(|y|, 6) and 2^e its binade (e >= 0, so m < 2 has
// e = 0), the code is RN(m 2^(1-e)) + 2e: 2^(1-e) from the exponent bits (exact), the product rounded to an
// integer, ties to even, by an FFMA onto 2^23 + 2 (one ulp is 1 there; 2^23 + 2 is even, so the sum's parity is
// the rounded product's), and 2e added as the biased exponent's double, 254 + 2e: 2 + 254 = 256 leaves the low
// byte exact. NaN gives 7 (the callers mask such blocks).
__device__ __forceinline__ u32 e2m1_magnitude(float y) {
    const float m = fminf(fabsf(y), 6.0f);
    const u32 binade = max(__float_as_uint(m) & 0x7f800000u, 0x3f800000u);  // 2^e, e = max(floor(log2 m), 0)
    const float t = __fmaf_rn(m, __uint_as_float(0x7f800000u - binade), 8388610.0f);  // m 2^(1-e) + 2^23 + 2
    return __float_as_uint(t) + (binade >> 22);
}

// Eight elements' codes (a 16-bit vector: words w, element 2i low in w[i]) times r, packed: element k in
// nibble k. Magnitudes pair into bytes (element 2i low), four bytes gather into the word; sign bytes
// (bit 7: bytes 1 and 3 of each word) permuted so that the even elements' signs shift to bits 8i + 3 and
// the odd ones' sit at 8i + 7.
template <int KIND>
__device__ __forceinline__ u32 codes8(const uint4& v, float r) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lo, hi;
        unpack2<KIND == kBf16>(w[i], lo, hi);
        pair[i] = e2m1_magnitude(__fmul_rn(lo, r)) + (e2m1_magnitude(__fmul_rn(hi, r)) << 4);
    }
    const u32 magnitudes = __byte_perm(__byte_perm(pair[0], pair[1], 0x0040), __byte_perm(pair[2], pair[3], 0x0040),
                                       0x5410);
    const u32 a = __byte_perm(w[0], w[1], 0x7351), b = __byte_perm(w[2], w[3], 0x7351);  // signs 0 2 1 3, 4 6 5 7
    const u32 even = __byte_perm(a, b, 0x5410), odd = __byte_perm(a, b, 0x7632);
    return magnitudes | ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

// Four fp32 elements' codes times r in the low 16 bits, element k in nibble k.
__device__ __forceinline__ u32 codes4(const uint4& v, float r) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = (e2m1_magnitude(__fmul_rn(__uint_as_float(w[i]), r)) & 7u) | ((w[i] >> 28) & 8u);
    return c[0] | c[1] << 4 | c[2] << 8 | c[3] << 12;
}

// A vector's codes: 32 bits for 16-bit inputs, 16 for fp32.
template <int KIND>
__device__ __forceinline__ u32 vector_codes(const uint4& v, float r) {
    if constexpr (KIND == kFp32) {
        return codes4(v, r);
    } else {
        return codes8<KIND>(v, r);
    }
}

// floor(log2(a)) of a positive finite fp32 (subnormals by their leading bit).
__device__ __forceinline__ int floor_log2(float a) {
    const u32 bits = __float_as_uint(a);
    return bits >= 0x00800000u ? (int)(bits >> 23) - 127 : -118 - __clz(bits);
}

// One block's scale code (the byte stored) and factor r (0 where the block's codes are all 0), from the block's
// folded magnitude bits. NVFP4: sf = e4m3fn(min((gs * amax) / 6, 448)), r = gs / sf. MXFP4: e clamped to
// [-127, 127], code e + 127, r = 2^-e (2^-127 a subnormal); an all-zero block code 0, one holding a NaN or an
// Inf (magnitude bits at or above the infinity's) 0xFF.
template <int FORMAT, int KIND>
__device__ __forceinline__ u32 block_scale(u32 magnitude, float gs, float& r) {
    const float amax = magnitude_value<KIND>(magnitude);
    if constexpr (FORMAT <= kNvfp4Dynamic) {
        const float scaled = __fdiv_rn(__fmul_rn(gs, amax), 6.0f);
        unsigned short pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(scaled));
        const u32 code = pair & 0xffu;
        float sf, unused;
        unpack2<false>(cvt_e4m3x2_f16x2(code), sf, unused);
        r = code == 0 ? 0.0f : __fdiv_rn(gs, sf);
        return code;
    } else {
        constexpr u32 kInfinity = KIND == kBf16 ? 0x7f80u : KIND == kFp16 ? 0x7c00u : 0x7f800000u;
        int e;
        if constexpr (FORMAT == kMxfp4Floor) {
            e = floor_log2(amax) - 2;  // e2m1's largest power of two is 2^2
        } else {
            const float d = __fdiv_rn(amax, 6.0f);
            const u32 bits = __float_as_uint(d);
            const bool power = (bits & 0x7fffffu) == 0 || (bits < 0x00800000u && (bits & (bits - 1)) == 0);
            e = d > 0.0f ? floor_log2(d) + (power ? 0 : 1) : 0;  // a d that underflows: frexp's exponent 0
        }
        e = min(max(e, -127), 127);
        const bool zero = magnitude == 0, nonfinite = magnitude >= kInfinity;
        r = zero || nonfinite ? 0.0f : __uint_as_float(e >= 127 ? 1u << 22 : (u32)(127 - e) << 23);
        return nonfinite ? 0xffu : zero ? 0u : (u32)(e + 127);
    }
}

// The byte offset of block scale (row, block): linear rows of `stride` bytes, or the 128x4 swizzle of a
// [rows', stride] array (r // 128, c // 4, r % 32, r % 128 // 32, c % 4).
template <bool SWIZZLED>
__device__ __forceinline__ i64 scale_offset(int row, int block, i64 stride) {
    if constexpr (SWIZZLED) {
        return (i64)(row >> 7) * (stride << 7) + (block >> 2) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 +
               (block & 3);
    } else {
        return (i64)row * stride + block;
    }
}

}  // namespace

// The kernel's parameter list is this struct's fields, in order (named ABI: _params.py).
struct QuantizeFp4Params {
    const unsigned char* x;  // [M, K], element strides (x_stride, 1)
    unsigned char* q;        // [M, K / 2] packed codes, rows of q_stride bytes
    unsigned char* scale;    // block scale bytes, linear rows of scale_stride or swizzled with scale_stride columns
    const float* gs_in;      // NVFP4's passed-in global scale (kNvfp4Given), else unused
    float* gs_out;           // NVFP4's global scale out (one fp32), else unused
    const float* partials;   // kNvfp4Dynamic: quantize_rows' per-CTA maxima, num_partials of them
    int rows, blocks, tasks_per_row, row_shift, num_partials;
    i64 row_magic;           // task / tasks_per_row = (task * row_magic) >> row_shift (task < 2^31)
    i64 x_stride, q_stride, scale_stride;
};

// Warp task t: row t / tasks_per_row, blocks from (t % tasks_per_row) * SLOTS * (32 / LANES); in slot s, lane l
// takes block s * (32 / LANES) + l / LANES of the run, vector l % LANES of it: a slot of the warp is 512
// contiguous bytes of the row.
template <int FORMAT, int KIND, bool SWIZZLED, int SLOTS>
__global__ void __launch_bounds__(kWarps * 32, kMinCtas) quantize_fp4(
    const unsigned char* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scale,
    const float* __restrict__ gs_in, float* __restrict__ gs_out, const float* __restrict__ partials, int rows,
    int blocks, int tasks_per_row, int row_shift, int num_partials, i64 row_magic, i64 x_stride, i64 q_stride,
    i64 scale_stride) {
    constexpr int kElem = KIND == kFp32 ? 4 : 2, kLanes = kBlock<FORMAT> / kVec<KIND>, kPerSlot = 32 / kLanes;
    constexpr int kCodeBytes = kVec<KIND> / 2, kOwn = (SLOTS + kLanes - 1) / kLanes;
    wait_for_previous_grid();
    allow_next_grid();
    float gs = 1.0f;
    if constexpr (FORMAT == kNvfp4Given) {
        gs = *gs_in;
    } else if constexpr (FORMAT == kNvfp4Dynamic) {
        const float amax = __uint_as_float(cta_max(partials_max(partials, num_partials, kWarps * 32)));
        gs = amax > 0.0f ? __fdiv_rn(kGlobalNumerator, amax) : 1.0f;
    }
    if constexpr (FORMAT <= kNvfp4Dynamic) {
        if (blockIdx.x == 0 && threadIdx.x == 0) *gs_out = gs;
    }
    const unsigned task = blockIdx.x * kWarps + (threadIdx.x >> 5);  // warp-uniform
    if (task >= (unsigned)rows * (unsigned)tasks_per_row) return;
    const int lane = threadIdx.x & 31, member = lane % kLanes;
    const int row = (int)(((u64)task * (u64)row_magic) >> row_shift);
    const int first = (task - row * tasks_per_row) * (SLOTS * kPerSlot) + lane / kLanes;  // this lane's slot-0 block
    const int first_col = first * kBlock<FORMAT> + member * kVec<KIND>;
    const unsigned char* x_at = x + ((i64)row * x_stride + first_col) * kElem;  // slot s: + s * 512 bytes
    unsigned char* q_at = q + (i64)row * q_stride + first_col / 2;
    uint4 v[SLOTS];
    bool in[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        in[s] = first + s * kPerSlot < blocks;
        v[s] = in[s] ? stream_load(x_at + s * 512) : make_uint4(0, 0, 0, 0);
    }
    u32 m[SLOTS];
    slot_maxima<KIND, kLanes, SLOTS>(v, m);
    // Member `member` of a block's lanes computes slots member, member + kLanes, ...: one scale a thread where
    // SLOTS <= kLanes instead of SLOTS; each r then comes from its member by a shuffle.
    float own[kOwn];
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
        u32 mine = m[j * kLanes < SLOTS ? j * kLanes : 0];
#pragma unroll
        for (int t = 1; t < kLanes; ++t) {
            if (j * kLanes + t < SLOTS) mine = member == t ? m[j * kLanes + t] : mine;
        }
        const u32 code = block_scale<FORMAT, KIND>(mine, gs, own[j]);
        const int slot = j * kLanes + member, block = first + j * kLanes * kPerSlot;  // slot j * kLanes's block
        if (slot < SLOTS && block + member * kPerSlot < blocks)
            scale[scale_offset<SWIZZLED>(row, block + member * kPerSlot, scale_stride)] = (unsigned char)code;
    }
    const int base = lane - member;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        const float r = __shfl_sync(0xffffffffu, own[s / kLanes], base + s % kLanes);
        if (in[s]) {
            const u32 c = r != 0.0f ? vector_codes<KIND>(v[s], r) : 0u;
            if constexpr (kCodeBytes == 4) {
                *reinterpret_cast<u32*>(q_at + s * kPerSlot * kBlock<FORMAT> / 2) = c;
            } else {
                *reinterpret_cast<u16*>(q_at + s * kPerSlot * kBlock<FORMAT> / 2) = (u16)c;
            }
        }
    }
}
