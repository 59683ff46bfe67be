// kernelmux cuda backend: quantize_fp8's kernels (e4m3fn codes, sm_89+ for the hardware cast; registered for
// Hopper, where they are measured). Host side: quantize_fp8.py; the arithmetic below and the helpers
// shared with quantize_fp4.cu and fused_moe_sm90.cu are in quantize_common.cuh.
//
// The triton backend's kernels stop at 48-80% of the copy rate on an H200, issue-bound at ~20 SASS instructions
// an element. These keep the spec's arithmetic bit for bit and spend few instructions an element:
//   - 16-byte loads; |x| maxima on the input's own bits (non-negative floats order as unsigned integers: two
//     16-bit maxima a VIMNMX for bf16/fp16), widened to fp32 once per group or row;
//   - the scale by an IEEE division (with the spec's floors, ue8m0 on the bits), its correctly rounded
//     reciprocal once per group or row; each quotient x * r corrected by one FMA residual (Markstein), x's
//     sign bit copied onto it, rows of scales below 2^-100 rescaled by 2^64 first (the triton kernel's
//     _codes says why each step is needed); under ue8m0 the reciprocal of a power of two is exact, and so is
//     x * r: the quotient is one multiply;
//   - codes by cvt.rn.satfinite.e4m3x2.f32 (round to nearest even; the quotients are within an ulp of 448).
// Kernels:
//   - quantize_groups: per_group; a warp task is a run of SLOTS x (32 / LANES) groups of one row, LANES
//     threads a group (a 16-byte vector each), SLOTS vectors a thread in flight; group maxima by xor
//     shuffles; lane s of a group computes slot s's scale and reciprocal, shuffled to the others, and
//     stores it through the scale's strides (K-major or MN-major: no transpose pass).
//   - quantize_rows: per_token (a CTA a row: the first VECS vectors a thread held in registers from the
//     maximum to the codes, the rest of a wider row read again, from L2), per_tensor in one CTA (small M:
//     maxima then codes over every row), and per_tensor's two passes (AMAX: a CTA's maximum into a
//     workspace; PARTIALS: each CTA reduces those maxima, CTA 0 stores the scale, and the CTAs take their
//     rows in the reverse order of the first pass, so the rows read last, still in L2, are read first).

#include "quantize_common.cuh"

namespace {

constexpr int kGroupWarps = 8;               // quantize_groups' CTA (the host's GROUP_THREADS)

// quantize_rows' modes (the host's ROW_MODES).
constexpr int kToken = 0, kTensor = 1, kPartials = 2, kAmax = 3;

// Codes of a 16-byte vector: 8 bytes for 16-bit inputs (a uint2), 4 for fp32 (in .x). The sign bit of each
// input element is ORed onto its code (bit 7): a no-op where the quotient has it already, the -0 code (0x80)
// where the correction gave +0. For 16-bit inputs one byte permute gathers four elements' sign bytes.
template <int KIND, bool POW2, bool RESCALE>
__device__ __forceinline__ uint2 codes(const uint4& v, const Divisor& d) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    if constexpr (KIND == kFp32) {
        float f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = quotient<POW2, RESCALE>(__uint_as_float(w[i]), d);
        u32 c = e4m3x2(f[0], f[1]) | e4m3x2(f[2], f[3]) << 16;
        if constexpr (!POW2) c |= __byte_perm(__byte_perm(w[0], w[1], 0x0073), __byte_perm(w[2], w[3], 0x0073),
                                              0x5410) & 0x80808080u;
        return make_uint2(c, 0);
    } else {
        u32 pair[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float lo, hi;
            unpack2<KIND == kBf16>(w[i], lo, hi);
            pair[i] = e4m3x2(quotient<POW2, RESCALE>(lo, d), quotient<POW2, RESCALE>(hi, d));
        }
        uint2 c = make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
        if constexpr (!POW2) {  // element 2i's sign is bit 15 of w[i] (byte 1), element 2i + 1's bit 31 (byte 3)
            c.x |= __byte_perm(w[0], w[1], 0x7531) & 0x80808080u;
            c.y |= __byte_perm(w[2], w[3], 0x7531) & 0x80808080u;
        }
        return c;
    }
}

template <int KIND>
__device__ __forceinline__ void store_codes(unsigned char* p, const uint2& c) {
    if constexpr (KIND == kFp32) {
        *reinterpret_cast<u32*>(p) = c.x;
    } else {
        *reinterpret_cast<uint2*>(p) = c;
    }
}

}  // namespace

// The kernels' parameter lists are these structs' fields, in order (named ABI: _params.py).
struct QuantizeGroupsParams {
    const unsigned char* x;  // [M, K], element strides (x_stride, 1)
    unsigned char* q;        // [M, K] codes, contiguous rows of q_stride bytes
    float* scale;            // [M, G] at (scale_stride_m, scale_stride_g)
    int rows, cols, groups, tasks_per_row, row_shift;
    i64 row_magic;           // task / tasks_per_row = (task * row_magic) >> row_shift (task < 2^31)
    i64 x_stride, q_stride, scale_stride_m, scale_stride_g;
};

struct QuantizeRowsParams {
    const unsigned char* x;
    unsigned char* q;
    float* scale;            // [M, 1] (kToken) or [1]
    float* partials;         // per_tensor's per-CTA maxima (kAmax writes, kPartials reads); else unused
    int rows, cols, rows_per_cta, num_partials;
    i64 x_stride, q_stride, scale_stride;
};

// per_group: groups of LANES x kVec elements. Warp task t: row t / tasks_per_row, groups from
// (t % tasks_per_row) * SLOTS * (32 / LANES); in slot s, lane l takes group s * (32 / LANES) + l / LANES of
// the run, vector l % LANES of it: a slot of the warp is 512 contiguous bytes of the row.
template <int KIND, bool UE8M0, int LANES, int SLOTS>
__global__ void __launch_bounds__(kGroupWarps * 32) quantize_groups(
    const unsigned char* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, int rows, int cols,
    int groups, int tasks_per_row, int row_shift, i64 row_magic, i64 x_stride, i64 q_stride, i64 scale_stride_m,
    i64 scale_stride_g) {
    constexpr int kElem = KIND == kFp32 ? 4 : 2, kPerSlot = 32 / LANES, kGroupSize = LANES * kVec<KIND>;
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two up to a warp");
    wait_for_previous_grid();
    allow_next_grid();
    const unsigned task = blockIdx.x * kGroupWarps + (threadIdx.x >> 5);  // warp-uniform
    if (task >= (unsigned)rows * (unsigned)tasks_per_row) return;
    const int lane = threadIdx.x & 31, member = lane % LANES;
    const int row = (int)(((u64)task * (u64)row_magic) >> row_shift);  // a multiply, not a division's ~25
    const int first = (task - row * tasks_per_row) * (SLOTS * kPerSlot) + lane / LANES;  // this lane's slot-0 group
    const int first_col = first * kGroupSize + member * kVec<KIND>;
    const unsigned char* x_at = x + ((i64)row * x_stride + first_col) * kElem;  // slot s: + s * 512 bytes
    unsigned char* q_at = q + (i64)row * q_stride + first_col;
    uint4 v[SLOTS];
    bool in[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        in[s] = first + s * kPerSlot < groups && first_col + s * kPerSlot * kGroupSize < cols;
        v[s] = in[s] ? stream_load(x_at + s * kPerSlot * kGroupSize * kElem) : make_uint4(0, 0, 0, 0);
    }
    u32 m[SLOTS];
    slot_maxima<KIND, LANES, SLOTS>(v, m);
    Divisor d[SLOTS];
    if constexpr (SLOTS <= LANES) {
        // Member s of each group computes slot s's scale: one division a thread instead of SLOTS.
        u32 mine = m[0];
#pragma unroll
        for (int s = 1; s < SLOTS; ++s) mine = member == s ? m[s] : mine;
        const float own = scale_of<true, UE8M0>(magnitude_value<KIND>(mine));
        const Divisor shared = divisor<UE8M0, true>(own);
        const int group = first + member * kPerSlot;
        if (member < SLOTS && group < groups) scale[(i64)row * scale_stride_m + (i64)group * scale_stride_g] = own;
        const int base = lane - member;
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            d[s].scale = __shfl_sync(0xffffffffu, shared.scale, base + s);
            d[s].reciprocal = __shfl_sync(0xffffffffu, shared.reciprocal, base + s);
            d[s].factor = 1.0f;
        }
    } else {
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            const float own = scale_of<true, UE8M0>(magnitude_value<KIND>(m[s]));
            d[s] = divisor<UE8M0, true>(own);
            const int group = first + s * kPerSlot;
            if (member == 0 && group < groups) scale[(i64)row * scale_stride_m + (i64)group * scale_stride_g] = own;
        }
    }
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        if (in[s]) store_codes<KIND>(q_at + s * kPerSlot * kGroupSize, codes<KIND, UE8M0, false>(v[s], d[s]));
    }
}

namespace {

// Vectors start, start + threads, ... (VECS of them) of a row of `vectors`, zeros past its end: VECS loads in flight.
template <int VECS>
__device__ __forceinline__ void load_vectors(const unsigned char* x_row, int start, int threads, int vectors,
                                             uint4 (&v)[VECS]) {
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
        const int vec = start + i * threads;
        v[i] = vec < vectors ? stream_load(x_row + (i64)vec * 16) : make_uint4(0, 0, 0, 0);
    }
}

// The codes of rows [r0, r1): the first VECS vectors a thread of row r0 from `held` (kToken), the rest read
// again (VECS loads in flight a thread).
template <int KIND, bool POW2, bool RESCALE, int VECS, bool HELD>
__device__ __forceinline__ void row_codes(const unsigned char* __restrict__ x, unsigned char* __restrict__ q, int r0,
                                          int r1, int vectors, i64 x_stride, i64 q_stride, const uint4 (&held)[VECS],
                                          const Divisor& d) {
    constexpr int kElem = KIND == kFp32 ? 4 : 2, kCodeBytes = kVec<KIND>;
    const int threads = blockDim.x;
    for (int r = r0; r < r1; ++r) {
        const unsigned char* x_row = x + (i64)r * x_stride * kElem;
        unsigned char* q_row = q + (i64)r * q_stride;
        int start = threadIdx.x;
        if (HELD) {
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int vec = start + i * threads;
                if (vec < vectors) store_codes<KIND>(q_row + vec * kCodeBytes, codes<KIND, POW2, RESCALE>(held[i], d));
            }
            start += VECS * threads;
        }
        for (; start < vectors; start += VECS * threads) {
            uint4 v[VECS];
            load_vectors(x_row, start, threads, vectors, v);
#pragma unroll
            for (int i = 0; i < VECS; ++i) {
                const int vec = start + i * threads;
                if (vec < vectors) store_codes<KIND>(q_row + vec * kCodeBytes, codes<KIND, POW2, RESCALE>(v[i], d));
            }
        }
    }
}

}  // namespace

// Rows: per_token (kToken, a CTA a row), per_tensor in one CTA (kTensor: rows_per_cta = M), or per_tensor's
// passes (kAmax: the CTA's maximum into partials[cta]; kPartials: the maximum of num_partials partials, the CTAs
// taking their rows in reverse order). cols is a multiple of kVec (16-byte vectors, no element tail).
// kToken's CTA holds up to 512 threads, 256 at 8 vectors a thread (fp16's unpacking spills at 128 registers): the
// host's token_max_warps.
template <int KIND, bool UE8M0, int MODE, int VECS>
__global__ void __launch_bounds__(MODE == kToken ? (VECS >= 8 ? 256 : 512) : 1024) quantize_rows(
    const unsigned char* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale,
    float* __restrict__ partials, int rows, int cols, int rows_per_cta, int num_partials, i64 x_stride, i64 q_stride,
    i64 scale_stride) {
    constexpr int kElem = KIND == kFp32 ? 4 : 2;
    constexpr bool kHeld = MODE == kToken;
    wait_for_previous_grid();
    allow_next_grid();
    const int cta = MODE == kPartials ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int r0 = cta * rows_per_cta, r1 = min(rows, r0 + rows_per_cta);
    const int vectors = cols / kVec<KIND>, threads = blockDim.x;
    uint4 held[VECS];
    u32 m = 0;
    if constexpr (MODE == kPartials) {
        m = partials_max(partials, num_partials, threads);
    } else {
        for (int r = r0; r < r1; ++r) {
            const unsigned char* x_row = x + (i64)r * x_stride * kElem;
            int start = threadIdx.x;
            if (kHeld) {
                load_vectors(x_row, start, threads, vectors, held);
#pragma unroll
                for (int i = 0; i < VECS; ++i) m = magnitude_max<KIND>(held[i], m);
                start += VECS * threads;
            }
            for (; start < vectors; start += VECS * threads) {
                uint4 v[VECS];
                load_vectors(x_row, start, threads, vectors, v);
#pragma unroll
                for (int i = 0; i < VECS; ++i) m = magnitude_max<KIND>(v[i], m);
            }
        }
        m = fold<KIND>(m);
    }
    m = cta_max(m);
    const float amax = MODE == kPartials ? __uint_as_float(m) : magnitude_value<KIND>(m);
    if constexpr (MODE == kAmax) {
        if (threadIdx.x == 0) partials[cta] = amax;
        return;
    } else {
        const float s = scale_of<false, UE8M0>(amax);
        if (threadIdx.x == 0 && (MODE == kToken || cta == 0)) scale[MODE == kToken ? (i64)r0 * scale_stride : 0] = s;
        const Divisor d = divisor<UE8M0, false>(s);
        if (!UE8M0 && d.factor != 1.0f) {  // a row (or tensor) of scale below 2^-100: rare, its own loop
            row_codes<KIND, false, true, VECS, kHeld>(x, q, r0, r1, vectors, x_stride, q_stride, held, d);
        } else {
            row_codes<KIND, UE8M0, false, VECS, kHeld>(x, q, r0, r1, vectors, x_stride, q_stride, held, d);
        }
    }
}
