// kernelmux cuda backend: paged-attention decode over an fp8 e4m3 KV cache (head dim 128).
//
// One CTA per (KV head, sequence, split), WARPS warps. Each warp streams its own 32-position
// steps of the CTA's KV range (warp w takes steps w, w + WARPS, ...) with its own online softmax,
// so nothing is shared between warps until the end, where one pass through shared memory
// combines them. Everything in between stays in registers:
//
//   scores^T = K . Q^T    mma.m16n8k16, A = 16 positions x 16 dims of K (from registers),
//                         B = 16 dims x 8 query heads of Q (loaded once), C = 16 positions x 8 heads
//   out^T   += V^T . P^T  A = 16 value dims x 16 positions of V, B = P^T (the score fragment
//                         transposed by movmatrix), C = 16 value dims x 8 heads
//
// Putting the KV positions (not the query heads) on the MMA's 16 rows wastes nothing at the
// GQA group of 8 (the heads fill the 8 columns), and both reductions can be ordered freely:
// the head dims of q . k and the positions of p . v are sums. This kernel picks those orders so
// that a lane's share of a KV row is one or two 16-byte runs, and each load instruction of a
// warp covers whole 32-byte sectors:
//   - q . k, dim chunk kc (16 of the 128 dims): lane (g, t) = (lane / 4, lane % 4) holds the
//     A elements k = 2t, 2t+1, 2t+8, 2t+9, which this kernel maps to dims 16t + 4kc + 0..3
//     (kc < 4) and 64 + 16t + 4(kc - 4) + 0..3 (kc >= 4): a lane reads bytes 16t .. 16t + 15
//     and 64 + 16t .. 64 + 16t + 15 of each of its two K rows (positions g and g + 8).
//   - p . v, value-dim tile mt (16 of the 128 output dims): lane (g, t) holds the A rows g and
//     g + 8, mapped to dims 16g + 2mt and 16g + 2mt + 1, so a lane reads 16 contiguous bytes of
//     each of its four V rows (positions 2t, 2t+1, 2t+8, 2t+9); byte permutes pair two
//     positions' values of one dim into the A operand's 16-bit pairs.
// Every cache read is a 16-byte load straight from global memory into the fragment's lane:
// no shared-memory staging, no byte-wide loads. e4m3 -> fp16 is one cvt per two values; the
// MMAs run in fp16 with fp32 accumulation (a bf16 query is scaled into fp16's range by a power
// of two, as the triton backend does).
//
// Output: either the normalized result in the query's dtype (one split) or, with SPLIT, each
// split's unnormalized partial (times v_scale), running max (base 2) and sum, merged by
// merge_splits (split_kv_merge.cuh). Compiled at runtime by NVRTC (with common.cuh, no CUDA headers); see
// _paged_decode.py.

#include "common.cuh"
#include "diagnostics.cuh"
#include "split_kv_merge.cuh"

struct __align__(16) Bytes16 {
    u32 w[4];
};

namespace {

constexpr int kHeadDim = 128;
constexpr int kStep = 32;  // KV positions per warp step: two 16-position MMA row tiles

__device__ __forceinline__ Bytes16 load16(const unsigned char* p) {
    Bytes16 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
        : "l"(p));
    return v;
}

// A read through L2 only (never L1), for values that may still change: see the warm start.
__device__ __forceinline__ int load_through_l2(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Fetch `bytes` (a multiple of 16, from a 16-byte aligned address) into L2; nothing returns.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ Bytes16 zero16() {
    Bytes16 v;
    v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
    return v;
}

// Four e4m3 values (bytes 0..3 of w) -> two f16x2: (byte0, byte1) and (byte2, byte3).
__device__ __forceinline__ void e4m3x4_to_f16x2x2(u32 w, u32& lo, u32& hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __int_as_float(((u32)x) << 16); }

// Four output values times `mul`, rounded to the query's dtype, as one 8-byte store.
template <bool Q_BF16>
__device__ __forceinline__ void store4(unsigned char* p, float4 v, float mul) {
    *reinterpret_cast<uint2*>(p) =
        make_uint2(pack2<Q_BF16>(v.x * mul, v.y * mul), pack2<Q_BF16>(v.z * mul, v.w * mul));
}

__device__ __forceinline__ float finite_abs(float x) {
    float a = fabsf(x);
    return a < __int_as_float(0x7f800000) ? a : 0.0f;  // NaN and inf compare false
}

}  // namespace

// KERNELMUX_DIAG_TRACE's marks (TRACE_MARK, slots 0-7): diagnostics.cuh.

// The kernel's parameters are this struct's fields, in order: the host fills its mirror
// (_params.PagedDecodeParams) and launches with a pointer to each of its fields; the host appends static_asserts
// holding the kernel's parameter list, this struct and the mirror to one list of types.
struct PagedDecodeParams {
    const unsigned char* query;
    const unsigned char* k_cache;
    const unsigned char* v_cache;
    unsigned char* out;
    float* part_acc;
    float* part_ml;
    const int* cu_seqlens_q;
    const int* block_table;
    const int* seq_lens;
    const float* sinks;
    const float* k_scale;
    const float* v_scale;
    int num_tokens, num_q_heads, group, num_splits, window, launch_next_early, warm_start, table_width,
        num_cache_blocks;
    float scale, soft_cap;
    i64 q_stride_t, q_stride_h, o_stride_t, o_stride_h;
    i64 k_stride_b, k_stride_s, k_stride_h;
    i64 v_stride_b, v_stride_s, v_stride_h;
    i64 table_stride;
};

// HEAD_TILES: query heads per KV head padded to 8 * HEAD_TILES (the MMA's 8 columns each).
// Q_BF16: bf16 query and output (else fp16). PAGE_SHIFT: log2 of the cache block size.
// AHEAD: the next step's K is read while this step's softmax and values run (more registers).
// Occupancy: 16 warps per SM (128 registers a thread: four 4-warp CTAs or one of 16 warps) for
// one head tile with whole 16-position tiles per cache block, without AHEAD or soft cap; lookups
// per position (blocks under 16), AHEAD, soft cap or a second head tile need more registers than
// that without spilling (12 or 8 warps per SM; _paged_decode.py asks for no more warps per CTA).
// Dynamic shared memory: the warps' states for the combine, WARPS * HEAD_TILES * 8 * 128 floats
// (64 KiB at 16 warps, past the 48 KiB a static array may hold).
// launch_next_early: let the next kernel on the stream launch once this grid is running (a grid
// of one wave that leaves SMs idle and has no merge after it; the next kernel still waits for
// this one to finish before it reads anything). warm_start: this grid was launched overlapping
// the previous kernel, so it warms L2 before waiting for it (below). table_width and
// num_cache_blocks bound what the warm start reads and prefetches.
template <int HEAD_TILES, bool Q_BF16, int PAGE_SHIFT, bool SOFT_CAP, bool SPLIT, bool AHEAD, int WARPS>
__global__ void __launch_bounds__(
    WARPS * 32, (HEAD_TILES == 1 ? (PAGE_SHIFT >= 4 && !AHEAD && !SOFT_CAP ? 16 : 12) : 8) / WARPS)
    paged_decode_fp8(
    const unsigned char* __restrict__ query,    // [T, Hq, 128] bf16 / fp16
    const unsigned char* __restrict__ k_cache,  // [blocks, block_size, Hkv, 128] e4m3
    const unsigned char* __restrict__ v_cache,
    unsigned char* __restrict__ out,            // [T, Hq, 128] query dtype (not SPLIT)
    float* __restrict__ part_acc,               // [splits, T, Hq, 128] (SPLIT)
    float* __restrict__ part_ml,                // [2, splits, T, Hq]: max (base 2), sum (SPLIT)
    const int* __restrict__ cu_seqlens_q,       // [B + 1]
    const int* __restrict__ block_table,        // [B, max_blocks]
    const int* __restrict__ seq_lens,           // [B]
    const float* __restrict__ sinks,            // [Hq] or null
    const float* __restrict__ k_scale,          // scalar or null
    const float* __restrict__ v_scale,          // scalar or null
    int num_tokens, int num_q_heads, int group, int num_splits, int window, int launch_next_early,
    int warm_start, int table_width, int num_cache_blocks,
    float scale, float soft_cap,
    i64 q_stride_t, i64 q_stride_h, i64 o_stride_t, i64 o_stride_h,
    i64 k_stride_b, i64 k_stride_s, i64 k_stride_h,
    i64 v_stride_b, i64 v_stride_s, i64 v_stride_h,
    i64 table_stride) {
    constexpr int kPage = 1 << PAGE_SHIFT;
    extern __shared__ __align__(16) float sm_dynamic[];
    // [WARPS]: each lane's accumulator as 8 float4 (value-dim tiles), at state_slot(g, t)
    auto sm_acc = reinterpret_cast<float4 (*)[HEAD_TILES][8][32]>(sm_dynamic);
    __shared__ float sm_m[WARPS][HEAD_TILES * 8];
    __shared__ float sm_l[WARPS][HEAD_TILES * 8];
    __shared__ float sm_sink[HEAD_TILES * 8];  // per head of the group (-inf: none)
    __shared__ float sm_v_mul;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kv_head = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
    TRACE_MARKS;
    const int* table = block_table + (i64)seq * table_stride;
    // Where this KV head's rows lie: the K or V row (kHeadDim bytes) of a cache position in a
    // cache block, and a token's query row for head h of the group (2 bytes an element).
    const unsigned char* k_rows = k_cache + (i64)kv_head * k_stride_h;
    const unsigned char* v_rows = v_cache + (i64)kv_head * v_stride_h;
    const auto k_row = [&](i64 block, int pos) {
        return k_rows + block * k_stride_b + (i64)(pos & (kPage - 1)) * k_stride_s;
    };
    const auto v_row = [&](i64 block, int pos) {
        return v_rows + block * v_stride_b + (i64)(pos & (kPage - 1)) * v_stride_s;
    };
    const auto query_row = [&](int tok, int h) {
        return query + ((i64)tok * q_stride_t + (i64)(kv_head * group + h) * q_stride_h) * 2;
    };
    // KV range [lo, hi) of this CTA for a sequence of kv_len, walked in 32-position steps from
    // first, a multiple of 32 (so each 16-position tile lies inside one cache block when blocks
    // hold 16 or more).
    const auto kv_range = [&](int kv_len, int& lo, int& hi, int& first) {
        lo = window > 0 ? max(kv_len - window, 0) : 0;
        hi = kv_len;
        first = lo & ~(kStep - 1);
        if (SPLIT) {
            const int steps = (hi - first + kStep - 1) / kStep;
            const int share = (steps + num_splits - 1) / num_splits;
            first += split * share * kStep;
            lo = max(lo, first);
            hi = min(hi, first + share * kStep);
        }
    };
#if __CUDA_ARCH__ >= 900
    // Warm start: while the previous grid may still run (this one launched overlapping it), warm
    // L2 with what the first step's chain of dependent reads needs: the query offset, the
    // length, the table entries, then this warp's first 32 K and V rows and the query, so after
    // the wait that chain hits L2. What is read here may still change: it only chooses what to
    // prefetch, clamped into the table and the cache, and goes through L2 alone
    // (ld.global.cg), so no read after the wait can hit a stale L1 copy. The rows' prefetch is the
    // gain; the length and table read alone were slower than no warm start
    // (perf/decisions/paged_attention.md).
    if (warm_start) {
        const int guess_token = min(max(load_through_l2(cu_seqlens_q + seq), 0), num_tokens - 1);
        if (threadIdx.x < group)
            prefetch_l2(query_row(guess_token, threadIdx.x), 2 * kHeadDim);
        const int guess_len = (int)min((i64)max(load_through_l2(seq_lens + seq), 0), (i64)table_width << PAGE_SHIFT);
        int guess_lo, guess_hi, guess_first;
        kv_range(guess_len, guess_lo, guess_hi, guess_first);
        const int pos = guess_first + warp * kStep + lane;
        if (pos >= guess_lo && pos < guess_hi && num_cache_blocks > 0) {
            const i64 block = min(max(load_through_l2(table + (pos >> PAGE_SHIFT)), 0), num_cache_blocks - 1);
            prefetch_l2(k_row(block, pos), kHeadDim);
            prefetch_l2(v_row(block, pos), kHeadDim);
        }
    }
#endif
    wait_for_previous_grid();  // launched overlapping the previous kernel (_paged_decode.py): its writes first
    if (launch_next_early) allow_next_grid();
    TRACE_MARK(0, 0);
    const int token = cu_seqlens_q[seq];
    if (cu_seqlens_q[seq + 1] - token <= 0) {  // no query: nothing to write
        TRACE_WRITE();
        return;
    }
    const int kv_len = seq_lens[seq];
    TRACE_MARK(1, kv_len);
    int lo, hi, first;
    kv_range(kv_len, lo, hi, first);

    // Cache reads. A step reads, of each of its two 16-position tiles, K rows g and g + 8 and V
    // rows 2t, 2t+1, 2t+8, 2t+9; positions outside [lo, hi) read nothing (zeros): their scores are
    // masked, and a zero value row keeps 0 * garbage out of the sums. The first step's K is
    // requested before the query is read; with AHEAD the next step's K is requested once this
    // step's scores are computed (its V always once this step's values are summed).
    Bytes16 k_raw[2][2][2], v_raw[2][2][2];
    // Blocks of 16 positions or more: the cache block of each 16-position tile of this step,
    // and of the step this warp reads next (looked up a step ahead: the table read is not on
    // the path to the cache reads).
    int tile_block[2] = {0, 0}, ahead_block[2] = {0, 0};
    auto look_up = [&](int step) {
        if (PAGE_SHIFT >= 4 && step < hi) {
#pragma unroll
            for (int c = 0; c < 2; ++c) ahead_block[c] = table[min(step + 16 * c, hi - 1) >> PAGE_SHIFT];
        }
    };
    auto visible = [&](int pos) { return pos >= lo && pos < hi; };
    auto block_of = [&](int c, int pos) {
        return PAGE_SHIFT >= 4 ? tile_block[c] : table[min(pos, hi - 1) >> PAGE_SHIFT];
    };
    auto load_k = [&](int step) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            tile_block[c] = ahead_block[c];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pos = step + 16 * c + g + 8 * h;
                const unsigned char* p = k_row(block_of(c, pos), pos) + 16 * t;
                k_raw[c][h][0] = visible(pos) ? load16(p) : zero16();
                k_raw[c][h][1] = visible(pos) ? load16(p + 64) : zero16();
            }
        }
        look_up(step + WARPS * kStep);
    };
    auto load_v = [&](int step) {  // after load_k(step): reuses its cache blocks
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int pos = step + 16 * c + 8 * half + 2 * t + e;
                    const unsigned char* p = v_row(block_of(c, pos), pos) + 16 * g;
                    v_raw[c][half][e] = visible(pos) ? load16(p) : zero16();
                }
    };
    int step = first + warp * kStep;
    look_up(step);
#ifdef KERNELMUX_DIAG_TRACE
    // The first K row's arrival, timed by a load of its own (the loop's then hits in L2).
    if (PAGE_SHIFT >= 4 && step < hi) {
        const unsigned char* row = k_row(ahead_block[0], step) + 16 * t;
        TRACE_MARK(2, load16(row).w[0]);
    }
#endif
    if (AHEAD && step < hi) load_k(step);

    // The query slice of this lane: heads 8j + g of the group, the dims of its K bytes (16t ..
    // 16t + 15 and 64 + 16t .. 64 + 16t + 15). Word i of the slice holds its elements 2i, 2i + 1:
    // words 2kc and 2kc + 1 are the B operand of dim chunk kc, as K's word kc is its A operand.
    u32 qb[HEAD_TILES][16];
    // The epilogue's scalars are read with the query and kept in shared memory, so the epilogue
    // issues no global load (one issued after the stream would queue behind it; measured no
    // faster but no slower either, perf/decisions/paged_attention.md).
    const float v_mul = v_scale != nullptr ? *v_scale : 1.0f;
    const bool has_sink = !SPLIT && sinks != nullptr && threadIdx.x < group;
    const float sink = has_sink ? sinks[kv_head * group + threadIdx.x] : neg_inf();
#pragma unroll
    for (int j = 0; j < HEAD_TILES; ++j) {
        const int h = 8 * j + g;
        const unsigned char* row = query_row(token, h) + 32 * t;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const unsigned char* chunk = row + (c < 2 ? 16 * c : 128 + 16 * (c - 2));  // dims as K's bytes
            const Bytes16 v = h < group ? *reinterpret_cast<const Bytes16*>(chunk) : zero16();
#pragma unroll
            for (int i = 0; i < 4; ++i) qb[j][4 * c + i] = v.w[i];
        }
    }
    if (Q_BF16) {
        // To fp16, which holds bf16 values of magnitude 2^-14 .. 65504 exactly; a query whose
        // largest finite element reaches 2^15 is scaled down by 2^shift (exact) and the softmax
        // scale up by the same power.
        float largest = 0.0f;
#pragma unroll
        for (int j = 0; j < HEAD_TILES; ++j)
#pragma unroll
            for (int i = 0; i < 16; ++i)
                largest = fmaxf(largest, fmaxf(finite_abs(bf16_to_f32((u16)(qb[j][i] & 0xffffu))),
                                               finite_abs(bf16_to_f32((u16)(qb[j][i] >> 16)))));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
        const int shift = max(((__float_as_int(largest) >> 23) & 0xff) - (127 + 14), 0);
        const float down = __int_as_float((127 - shift) << 23);
        scale *= __int_as_float((127 + shift) << 23);
#pragma unroll
        for (int j = 0; j < HEAD_TILES; ++j)
#pragma unroll
            for (int i = 0; i < 16; ++i)
                qb[j][i] = pack2<false>(bf16_to_f32((u16)(qb[j][i] & 0xffffu)) * down,
                                        bf16_to_f32((u16)(qb[j][i] >> 16)) * down);
    }
    if (k_scale != nullptr) scale *= *k_scale;
    if (threadIdx.x == 0) sm_v_mul = v_mul;
    if (!SPLIT && threadIdx.x < HEAD_TILES * 8) sm_sink[threadIdx.x] = sink;
    const float score_scale = SOFT_CAP ? scale / soft_cap : scale * kLog2e;

    float m_run[HEAD_TILES][2], l_run[HEAD_TILES][2];
    float acc[8][HEAD_TILES][4];
#pragma unroll
    for (int j = 0; j < HEAD_TILES; ++j) {
        m_run[j][0] = m_run[j][1] = neg_inf();
        l_run[j][0] = l_run[j][1] = 0.0f;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
    }

    if (AHEAD && step < hi) load_v(step);
    while (step < hi) {
        const int next = step + WARPS * kStep;
        if (!AHEAD) {
            load_k(step);
            load_v(step);
        }
        // scores^T: s[c][j] = C fragment of positions tile c x heads 8j .. 8j + 7.
        float s[2][HEAD_TILES][4];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
            for (int j = 0; j < HEAD_TILES; ++j) s[c][j][0] = s[c][j][1] = s[c][j][2] = s[c][j][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < 8; ++kc) {
                u32 a0, a1, a2, a3;  // a0/a2: row g (dims 4kc + 0,1 / 2,3 of the slice), a1/a3: row g + 8
                e4m3x4_to_f16x2x2(k_raw[c][0][kc / 4].w[kc % 4], a0, a2);
                e4m3x4_to_f16x2x2(k_raw[c][1][kc / 4].w[kc % 4], a1, a3);
#pragma unroll
                for (int j = 0; j < HEAD_TILES; ++j) mma_f16(s[c][j], a0, a1, a2, a3, qb[j][2 * kc], qb[j][2 * kc + 1]);
            }
        }

        if (AHEAD && next < hi) load_k(next);  // K's registers are free once the scores are computed

        // Online softmax per head (heads 8j + 2t + e: element e + 2h of s[c][j] is position
        // 16c + g + 8h). Sums stay per lane until the end; maxima are shared by the 8 lanes of
        // a head (xor over g).
        u32 p_frag[2][HEAD_TILES][2];
#pragma unroll
        for (int j = 0; j < HEAD_TILES; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float mx = neg_inf();
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float x = s[c][j][e + 2 * h] * score_scale;
                        if (SOFT_CAP) {
                            // cap * tanh(x), tanh from one exp2 of -2|x|: no overflow for any x.
                            const float ex = exp2_approx(fabsf(x) * (-2.0f * kLog2e));
                            const float th = (1.0f - ex) / (1.0f + ex);
                            x = (x < 0.0f ? -th : th) * (soft_cap * kLog2e);
                        }
                        x = visible(step + 16 * c + g + 8 * h) ? x : neg_inf();
                        s[c][j][e + 2 * h] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float m_new = fmaxf(m_run[j][e], mx);
                const float m_use = m_new == neg_inf() ? 0.0f : m_new;
                const float alpha = exp2_approx(m_run[j][e] - m_use);
                m_run[j][e] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float p = exp2_approx(s[c][j][e + 2 * h] - m_use);
                        s[c][j][e + 2 * h] = p;
                        sum += p;
                    }
                l_run[j][e] = l_run[j][e] * alpha + sum;
#pragma unroll
                for (int mt = 0; mt < 8; ++mt) {
                    acc[mt][j][e] *= alpha;
                    acc[mt][j][e + 2] *= alpha;
                }
            }
            // P^T as the second MMA's B operand: transpose each 8 x 8 (positions x heads) block.
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                p_frag[c][j][0] = transpose8x8(pack2<false>(s[c][j][0], s[c][j][1]));
                p_frag[c][j][1] = transpose8x8(pack2<false>(s[c][j][2], s[c][j][3]));
            }
        }

        // out^T += V^T . P^T over both 16-position tiles.
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                u32 x0[2], x1[2];  // [half]: positions (2t, 2t+1) + 8 half, bytes 4w, 4w+1 / 4w+2, 4w+3
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    x0[half] = byte_perm(v_raw[c][half][0].w[w], v_raw[c][half][1].w[w], 0x5140u);
                    x1[half] = byte_perm(v_raw[c][half][0].w[w], v_raw[c][half][1].w[w], 0x7362u);
                }
#pragma unroll
                for (int sub = 0; sub < 2; ++sub) {  // value-dim tile mt = 2w + sub
                    u32 a0, a1, a2, a3;
                    e4m3x4_to_f16x2x2(sub == 0 ? x0[0] : x1[0], a0, a1);
                    e4m3x4_to_f16x2x2(sub == 0 ? x0[1] : x1[1], a2, a3);
#pragma unroll
                    for (int j = 0; j < HEAD_TILES; ++j)
                        mma_f16(acc[2 * w + sub][j], a0, a1, a2, a3, p_frag[c][j][0], p_frag[c][j][1]);
                }
            }
        if (AHEAD && next < hi) load_v(next);
        step = next;
    }

    TRACE_MARK(3, __float_as_uint(acc[0][0][0]));  // warp 0's last step done
    // Combine the warps: sums over the 8 lanes of each head, then shared memory. A lane's state
    // goes out as whole float4s (its four accumulators of a value-dim tile: heads 2t, 2t + 1 x
    // dims 2mt, 2mt + 1 of its 16), each tile's 32 at slots that spread every 8 lanes of a write
    // and every 8 readers of a read (the 8 lanes g of one t) over all 32 banks. Written as the
    // float2 pairs of one head, 8 lanes of a half warp shared a bank pair; this layout is faster
    // at the 70B fp8 decode's long contexts (perf/decisions/paged_attention.md).
    const auto state_slot = [](int lane_g, int lane_t) { return 8 * lane_t + ((lane_g + 2 * lane_t) & 7); };
#pragma unroll
    for (int j = 0; j < HEAD_TILES; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float l = l_run[j][e];
            l += __shfl_xor_sync(0xffffffffu, l, 4);
            l += __shfl_xor_sync(0xffffffffu, l, 8);
            l += __shfl_xor_sync(0xffffffffu, l, 16);
            const int h = 8 * j + 2 * t + e;
            if (g == 0) {
                sm_m[warp][h] = m_run[j][e];
                sm_l[warp][h] = l;
            }
        }
#pragma unroll
        for (int mt = 0; mt < 8; ++mt)
            sm_acc[warp][j][mt][state_slot(g, t)] =
                make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
    }
    __syncthreads();
    TRACE_MARK(4, 0);  // every warp done
    // A split grid's merge may launch once every CTA is past its stream (it still waits for this
    // grid's partials): faster at the split 70B fp8 shapes (perf/decisions/paged_attention.md).
    if (SPLIT) allow_next_grid();

    // Four dims of two heads (2t, 2t + 1 of a head tile) per thread and pass: 16-byte shared
    // reads, 16-byte partial and 8-byte output stores (the stores queue behind the other CTAs'
    // streaming loads, so fewer and wider finish sooner: halved a CTA's store time in the
    // decode trace, perf/decisions/paged_attention.md). Readers r .. r + 7 share (t, k) and take
    // g = 0 .. 7.
    for (int idx = threadIdx.x; idx < HEAD_TILES * 128; idx += WARPS * 32) {
        const int j = idx / 128, lane_t = (idx / 32) % 4, k = (idx / 8) % 4, lane_g = idx % 8;
        const int h0 = 8 * j + 2 * lane_t, d = 16 * lane_g + 4 * k, slot = state_slot(lane_g, lane_t);
        if (h0 >= group) continue;
        float m_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            m_max[0] = fmaxf(m_max[0], sm_m[w][h0]);
            m_max[1] = fmaxf(m_max[1], sm_m[w][h0 + 1]);
        }
        TRACE_MARK(6, __float_as_uint(m_max[0]));  // the warps' maxima read
        float m_use[2], total[2] = {0.0f, 0.0f};
        float4 value[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
#pragma unroll
        for (int e = 0; e < 2; ++e) m_use[e] = m_max[e] == neg_inf() ? 0.0f : m_max[e];
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float4 a = sm_acc[w][j][2 * k][slot], b = sm_acc[w][j][2 * k + 1][slot];
            const float weight0 = exp2_approx(sm_m[w][h0] - m_use[0]);  // 0 for warps that saw nothing
            const float weight1 = exp2_approx(sm_m[w][h0 + 1] - m_use[1]);
            total[0] += sm_l[w][h0] * weight0;
            total[1] += sm_l[w][h0 + 1] * weight1;
            value[0].x += a.x * weight0;
            value[0].y += a.z * weight0;
            value[0].z += b.x * weight0;
            value[0].w += b.z * weight0;
            value[1].x += a.y * weight1;
            value[1].y += a.w * weight1;
            value[1].z += b.y * weight1;
            value[1].w += b.w * weight1;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int h = h0 + e;
            if (h >= group) break;  // an odd group's last tile
            const int q_head = kv_head * group + h;
            if (SPLIT) {
                const float v_mul = sm_v_mul;
                const i64 ml = ((i64)split * num_tokens + token) * num_q_heads + q_head;
                *reinterpret_cast<float4*>(part_acc + ml * kHeadDim + d) = make_float4(
                    value[e].x * v_mul, value[e].y * v_mul, value[e].z * v_mul, value[e].w * v_mul);
                if (d == 0) {
                    part_ml[ml] = m_max[e];
                    part_ml[(i64)num_splits * num_tokens * num_q_heads + ml] = total[e];
                }
            } else {
                float denominator = total[e];
                denominator += exp2_approx(sm_sink[h] * kLog2e - m_use[e]);  // 0 without a sink
                if (denominator == 0.0f) denominator = 1.0f;  // nothing visible: zeros
                store4<Q_BF16>(out + ((i64)token * o_stride_t + (i64)q_head * o_stride_h + d) * 2, value[e],
                               sm_v_mul / denominator);
            }
        }
    }
    TRACE_MARK(5, 0);  // this thread's stores issued
    TRACE_WRITE();
}
