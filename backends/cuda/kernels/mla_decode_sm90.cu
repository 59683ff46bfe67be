// kernelmux cuda backend: mla_decode on Hopper (sm_90a) over 16-bit latent caches.
//
// Absorbed MLA: every head attends over one latent sequence of 576-wide rows (the 512 value dims,
// then 64 rope dims), so the kernel is a 576-deep Q K^T and a 512-wide P V per step, both on
// warpgroup MMAs (wgmma), which is what separates it from the triton kernel (mma.sync-class
// dots at 40% of bandwidth: the op is compute-balanced at 128 heads).
//
// One CTA takes 64 heads of one query token (one KV split of it when the host splits) and walks
// the token's visible positions in 64-position steps, its two warpgroups specialized (FlashMLA's
// division of labour; this is our own code):
//
//   - The 64 x 576 query tile and two 64 x 576 cache tiles live in shared memory in the layout
//     wgmma reads directly: nine 64-column blocks of 64 rows x 128 bytes, each row's 16-byte
//     chunks swizzled by the row's low three bits (128-byte swizzle). Warpgroup 1 fills them with
//     16-byte cp.async copies, step s + 2's tile streaming in while step s + 1's waits and step s
//     is computed. Positions past the token's visible length are zero-filled, never read (unread
//     cache slots may hold NaN), and masked out of the softmax.
//   - Warpgroup 0 computes the step's scores for all 64 positions (36 wgmma m64n64k16, Q and K
//     K-major, each read once from shared memory) and the softmax over whole rows, and writes the
//     probabilities (q's dtype) into a 64 x 64 tile and the rows' rescale factors beside it.
//   - Each warpgroup then accumulates P V for its 256 of the 512 value dims (4 wgmma
//     m64n256k16, V read from the same cache tile as an N-major operand): 128 fp32 accumulators
//     a thread.
//   - They hand work over through named barriers, each an arrive by one warpgroup and a sync by
//     the other: kFull + t (tile t landed: 1 -> 0), kPReady (P and the factors written: 0 -> 1),
//     kPFree (P read: 1 -> 0), kEmpty + t (warpgroup 0 done with tile t: 0 -> 1).
//   - The end divides by the row sums and writes the output and log-sum-exp, or, split, the
//     unnormalized partial with its running max and sum for merge_splits (split_kv_merge.cuh).
//
// The first version split every part between the warpgroups (each warpgroup the scores of 32
// positions, reading all of Q: the score MMAs were bound by shared-memory reads; row maxima
// traded every step) was slower: perf/decisions/mla_decode.md.
//
// Compiled at runtime by NVRTC for sm_90a (wgmma is an arch-specific feature); see mla_decode.py.
// KERNELMUX_DIAG_SKIP_{SCORES,VALUES,LOADS,CONVERT} leave one part out each (diagnostics.cuh).

#include "sm90_common.cuh"
#include "split_kv_merge.cuh"

namespace {

constexpr int kDim = 576;     // a latent row: 512 values, then 64 rope dims
constexpr int kRank = 512;    // value dims
constexpr int kHeads = 64;    // heads per CTA: the wgmma M
constexpr int kStep = 64;     // positions per step
constexpr int kThreads = 256;  // two warpgroups
constexpr int kColumnBlock = 64 * 128;              // 64 rows x 128 bytes (64 dims)
constexpr int kTile = kDim / 64 * kColumnBlock;     // a 64 x 576 tile: 73728 bytes
// Shared memory, from a 1024-byte aligned base (the swizzle pattern repeats every 1024 bytes):
// Q, two cache tiles, P (one column block), the rows' rescale factors [64] and sums [64].
constexpr int kQ = 0, kKV = kTile, kP = 3 * kTile, kStats = kP + kColumnBlock;
// Beside the stats (bf16 q over an fp8 cache): the power of two q's fp16 tile was scaled by, then
// the four loader warps' maxima that find it.
constexpr int kQScale = kStats + 2 * kHeads * 4, kQMaxima = kQScale + 16;
constexpr int kSharedBytes = kQMaxima + 16 + 1024;  // + room to align the base




// Two e4m3 values (the low and high byte) -> an f16x2, low value in the low half: exact, one
// instruction. (Into bf16 it takes three more a pair, the f16 bits re-based, and the call was slower:
// perf/decisions/mla_decode.md. So fp8 caches run fp16 MMAs.)
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
#ifdef KERNELMUX_DIAG_SKIP_CONVERT
    return two;
#else
    return cvt_e4m3x2_f16x2(two);
#endif
}


// Byte offset of 16-byte chunk `chunk` (0 .. 71) of row `row` (0 .. 63) in a tile: its column
// block, the row, and the chunk's slot XOR the row's low three bits (the 128-byte swizzle
// wgmma undoes when it reads; it also spreads a column's rows over all 32 banks).
__device__ __forceinline__ u32 tile_offset(int row, int chunk) {
    return (chunk >> 3) * kColumnBlock + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

struct __align__(16) Bytes16 {
    u32 w[4];
};

// A plain (L1-allocating) load: a loader reads each 128-byte line of a row in two 64-byte halves
// (fetch_fp8_tile), so the second half hits L1; L1::no_allocate and .cg were slower
// (perf/decisions/mla_decode.md).
__device__ __forceinline__ Bytes16 load16(const unsigned char* p) {
    Bytes16 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
                 : "l"(p));
    return v;
}

// An fp8 tile in two halves: loader l (of 128) reads 16-byte chunks l % 4 + 4k (k < 9) of rows
// l / 4 and l / 4 + 32, 576-byte rows from rows + r * stride; rows >= valid read as zeros.
__device__ __forceinline__ void fetch_fp8_tile(Bytes16 (&raw)[18], const unsigned char* rows, i64 stride, int valid,
                                               int loader) {
    const int row = loader >> 2, slot = loader & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const bool live = row + 32 * half < valid;
        const unsigned char* src = rows + (row + 32 * half) * stride + slot * 16;
#pragma unroll
        for (int k = 0; k < 9; ++k) {
            if (live) {
                raw[9 * half + k] = load16(src + 64 * k);
            } else {
#pragma unroll
                for (int x = 0; x < 4; ++x) raw[9 * half + k].w[x] = 0u;
            }
        }
    }
}

// fetch_fp8_tile's chunks converted (e4m3x2_to_f16x2) into the 16-bit tile layout: fp8 chunk c of a
// row is 16-bit chunks 2c and 2c + 1.
__device__ __forceinline__ void store_fp8_tile(u32 tile, const Bytes16 (&raw)[18], int loader) {
    const int row = loader >> 2, slot = loader & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int k = 0; k < 9; ++k) {
            const Bytes16& v = raw[9 * half + k];
            const int r = row + 32 * half, chunk = 2 * (slot + 4 * k);
#pragma unroll
            for (int part = 0; part < 2; ++part) {
                const u32 w0 = v.w[2 * part], w1 = v.w[2 * part + 1];
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(tile + tile_offset(r, chunk + part)),
                             "r"(e4m3x2_to_f16x2(w0)), "r"(e4m3x2_to_f16x2(w0 >> 16)),
                             "r"(e4m3x2_to_f16x2(w1)), "r"(e4m3x2_to_f16x2(w1 >> 16))
                             : "memory");
            }
        }
    }
}

// The chunk of a tile that thread `tid` of THREADS copies for row group `part` and column block
// `block`: chunk tid % 8 of row tid / 8 + part THREADS / 8 (a warp: four whole 128-byte row
// segments), so a thread's addresses are one per-thread offset plus constants.
template <int THREADS>
__device__ __forceinline__ u32 loader_chunk(u32 tile, int tid, int part, int block) {
    return tile + tile_offset(tid >> 3, tid & 7) + part * (THREADS / 8) * 128 + block * kColumnBlock;
}

// Rows 0 .. 63 of a tile, row r from rows + r * stride (bytes); rows >= valid are zero-filled
// and nothing is read for them, by THREADS threads, each copying its loader_chunk's.
template <int THREADS>
__device__ __forceinline__ void load_tile(u32 tile, const unsigned char* rows, i64 stride, int valid,
                                          int tid) {
    constexpr int kRowsAtOnce = THREADS / 8;
    const int row = tid >> 3, slot = tid & 7;
    const unsigned char* src = rows + row * stride + slot * 16;
#pragma unroll
    for (int part = 0; part < kStep / kRowsAtOnce; ++part) {
        const bool live = row + kRowsAtOnce * part < valid;
        const unsigned char* from = live ? src + kRowsAtOnce * part * stride : rows;
#pragma unroll
        for (int block = 0; block < kDim / 64; ++block)
            copy16(loader_chunk<THREADS>(tile, tid, part, block), from + block * 128, live ? 16u : 0u);
    }
}


// visit(address, words) for each of the 36 chunks of a 64 x 576 tile that load_tile<128> has
// thread `loader` copy (loader_chunk, the one map both use), read from shared memory. (A template,
// not a generic lambda: NVRTC 13.0 takes a generic lambda's call operator for a host function.)
template <class Visit>
__device__ __forceinline__ void for_each_loader_chunk(u32 tile, int loader, Visit&& visit) {
#pragma unroll
    for (int part = 0; part < kHeads / 16; ++part)
#pragma unroll
        for (int block = 0; block < kDim / 64; ++block) {
            const u32 address = loader_chunk<128>(tile, loader, part, block);
            u32 w[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(address));
            visit(address, w);
        }
}

// A bf16 query tile, as load_tile<128> copied it (thread `loader` its chunks), rewritten in place
// as fp16 times 2^-shift, where shift puts the tile's largest finite magnitude in [2^15, 2^16),
// fp16's top binade (clamped to +-100, so 2^shift stays a normal float). Every element within
// 2^32 of the largest stays exact (bf16's 8 significant bits fit fp16's 11, down to its
// subnormals); smaller ones round by at most 2^-40 of the largest: no score moves by more than
// fp32's own summation error. Returns 2^shift, which the scores are multiplied by. The 128 loader
// threads call it together (named barrier kMaxBarrier); `maxima` holds four floats of shared memory.
__device__ __forceinline__ float q_tile_to_f16(u32 tile, int loader, u32* maxima) {
    constexpr int kMaxBarrier = 7;  // mla_decode_sm90 uses 1 .. 6
    u32 largest = 0;  // bf16 magnitude bits: for finite values their order is the values' order
    for_each_loader_chunk(tile, loader, [&](u32, const u32 (&w)[4]) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const u32 lo = w[x] & 0x7fffu, hi = (w[x] >> 16) & 0x7fffu;
            largest = max(largest, lo < 0x7f80u ? lo : 0u);  // inf and NaN left out
            largest = max(largest, hi < 0x7f80u ? hi : 0u);
        }
    });
    largest = __reduce_max_sync(0xffffffffu, largest);
    if ((loader & 31) == 0) maxima[loader >> 5] = largest;
    bar_sync<128>(kMaxBarrier);
    largest = max(max(maxima[0], maxima[1]), max(maxima[2], maxima[3]));
    const int shift = min(max((int)(largest >> 7) - (127 + 15), -100), 100);  // bf16: 7 mantissa bits
    const float down = __int_as_float((127 - shift) << 23);
    for_each_loader_chunk(tile, loader, [&](u32 address, const u32 (&w)[4]) {
        u32 h[4];
#pragma unroll
        for (int x = 0; x < 4; ++x)
            h[x] = pack2<false>(__int_as_float(w[x] << 16) * down, __int_as_float(w[x] & 0xffff0000u) * down);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(h[0]), "r"(h[1]), "r"(h[2]),
                     "r"(h[3]) : "memory");
    });
    return __int_as_float((127 + shift) << 23);
}

// d[32] (+)= A (64 x 16, K-major) B (16 x 64, K-major); accumulate 0 overwrites d.
template <bool BF16>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], u64 a, u64 b, int accumulate) {
#define KM_MMA_N64(T)                                                                                  \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"                                  \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"                            \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "              \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "   \
                 "%32, %33, p, 1, 1, 0, 0;\n\t}"                                                      \
                 : KM_ACC8(d, 0), KM_ACC8(d, 8), KM_ACC8(d, 16), KM_ACC8(d, 24)                        \
                 : "l"(a), "l"(b), "r"(accumulate))
    if constexpr (BF16) {
        KM_MMA_N64("bf16");
    } else {
        KM_MMA_N64("f16");
    }
#undef KM_MMA_N64
}

// d[128] += A (64 x 16, K-major) B (16 x 256, N-major).
template <bool BF16>
__device__ __forceinline__ void mma_m64n256k16_bn(float (&d)[128], u64 a, u64 b) {
#define KM_MMA_N256(T)                                                                                 \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"                                   \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {"                           \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "              \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "    \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "    \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "    \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "    \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "    \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "    \
                 "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "      \
                 "%123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n\t}"                      \
                 : KM_ACC8(d, 0), KM_ACC8(d, 8), KM_ACC8(d, 16), KM_ACC8(d, 24), KM_ACC8(d, 32),       \
                   KM_ACC8(d, 40), KM_ACC8(d, 48), KM_ACC8(d, 56), KM_ACC8(d, 64), KM_ACC8(d, 72),     \
                   KM_ACC8(d, 80), KM_ACC8(d, 88), KM_ACC8(d, 96), KM_ACC8(d, 104), KM_ACC8(d, 112),   \
                   KM_ACC8(d, 120)                                                                     \
                 : "l"(a), "l"(b), "n"(1))
    if constexpr (BF16) {
        KM_MMA_N256("bf16");
    } else {
        KM_MMA_N256("f16");
    }
#undef KM_MMA_N256
}


// The wgmma operands' descriptors are a base plus compile-time offsets (a descriptor's low 14
// bits are the address / 16), from warp-uniform values only (`wg` comes from a lane-0 shuffle):
// they stay in uniform registers. Per-thread descriptors cost register-to-uniform moves before
// every wgmma, and branching on the warpgroup makes ptxas serialize the wgmmas.

// s = Q K^T for all 64 positions of the tile (one warpgroup).
template <bool BF16>
__device__ __forceinline__ void full_score_mmas(float (&s)[32], u32 q_tile, u32 kv_tile) {
    const u64 q_desc = descriptor(q_tile, 16, 1024), k_desc = descriptor(kv_tile, 16, 1024);
#pragma unroll
    for (int k = 0; k < kDim / 16; ++k) {
        const u64 offset = ((k >> 2) * kColumnBlock + (k & 3) * 32) >> 4;
        mma_m64n64k16<BF16>(s, q_desc + offset, k_desc + offset, k);
    }
}


// o += P V[:, 256 wg .. 256 wg + 255] over the tile's 64 positions.
template <bool BF16>
__device__ __forceinline__ void value_mmas(float (&o)[128], u32 p_tile, u32 kv_tile, int wg) {
    const u64 p_desc = descriptor(p_tile, 16, 1024);
    const u64 v_desc = descriptor(kv_tile + wg * 4 * kColumnBlock, kColumnBlock, 1024);
#pragma unroll
    for (int k = 0; k < kStep / 16; ++k)
        mma_m64n256k16_bn<BF16>(o, p_desc + ((k * 32) >> 4), v_desc + ((k * 16 * 128) >> 4));
}

}  // namespace

// The kernel's parameters are this struct's fields, in order: the host fills its mirror
// (_params.MlaDecodeParams) and launches with a pointer to each of its fields; the host appends static_asserts
// holding the kernel's parameter list, this struct and the mirror to one list of types.
struct MlaDecodeParams {
    const unsigned char* q;
    const unsigned char* kv;
    unsigned char* out;
    float* lse;
    float* part_acc;
    float* part_ml;
    const int* cu_seqlens_q;
    const int* block_table;
    const int* seq_lens;
    const float* kv_scale;
    int num_seqs, num_tokens, num_heads, num_splits, block_size, q_per_seq;
    float scale_log2;
    i64 q_stride_t, q_stride_h, o_stride_t, o_stride_h;
    i64 kv_stride_b, kv_stride_p;
    i64 table_stride;
};

// Grid (ceil(H / 64), T, splits), 256 threads, kSharedBytes of dynamic shared memory. Strides
// are in elements. part_acc == nullptr: one split, out and lse (if not null) written here;
// otherwise part_acc [splits, T, H, 512] and part_ml [2, splits, T, H] (running max in log2
// units of the scaled scores, then the row sum) for merge_splits (split_kv_merge.cuh). q_per_seq > 0 says every
// sequence has that many queries (the host knows it from T == B * max_query_len). The cache's
// strides are in bytes. CACHE_FP8: an e4m3 cache, converted by warpgroup 1 on its way into fp16
// tiles; its scale (kv_scale, null for 1) multiplies the scores and the output.
template <bool Q_BF16, bool CACHE_FP8>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_sm90(
    const unsigned char* __restrict__ q, const unsigned char* __restrict__ kv,
    unsigned char* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc,
    float* __restrict__ part_ml, const int* __restrict__ cu_seqlens_q, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, const float* __restrict__ kv_scale, int num_seqs, int num_tokens,
    int num_heads, int num_splits, int block_size, int q_per_seq, float scale_log2,
    i64 q_stride_t, i64 q_stride_h, i64 o_stride_t, i64 o_stride_h, i64 kv_stride_b, i64 kv_stride_p,
    i64 table_stride) {
    constexpr int kFull = 1, kPReady = 3, kPFree = 4, kEmpty = 5;  // named barrier ids (0: __syncthreads)
    wait_for_previous_grid();  // launched overlapping the previous kernel (mla_decode.py): its writes first
    extern __shared__ unsigned char shared_raw[];
    u32 dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < (u32)kSharedBytes) __trap();  // the host launched it with too little
    unsigned char* shared = shared_raw + ((1024u - (shared_address(shared_raw) & 1023u)) & 1023u);
    const u32 base = shared_address(shared);
    float* alpha_of = reinterpret_cast<float*>(shared + kStats);  // [row]: this step's rescale factor
    float* sum_of = alpha_of + kHeads;                             // [row]: the final row sums

    const int tid = threadIdx.x, lane = tid & 31, quad = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform as far as the compiler knows
    // This thread's accumulator rows (heads of the CTA): row0 and row0 + 8; its columns 8j + 2quad
    // (+1) of each 8-column group j.
    const int row0 = accumulator_row(tid);
    const int head0 = blockIdx.x * kHeads, token = blockIdx.y, split = blockIdx.z;
    // The cache's values are value_scale times what the tiles hold (fp8: its scale): scores and
    // output carry it.
    float value_scale = 1.0f;
    if constexpr (CACHE_FP8) {
        value_scale = kv_scale != nullptr ? *kv_scale : 1.0f;
        scale_log2 *= value_scale;
    }
    // The MMAs' operand type: q's, except over an fp8 cache, where the tiles are fp16 (e4m3 converts
    // to it exactly in one instruction) and a bf16 q is converted once, scaled by a power of two
    // (q_tile_to_f16) that the scores undo.
    constexpr bool kMmaBf16 = Q_BF16 && !CACHE_FP8;
    float* q_scale_of = reinterpret_cast<float*>(shared + kQScale);

    // The token's sequence: cu_seqlens_q[seq] <= token < cu_seqlens_q[seq + 1] (sequences
    // without queries have equal bounds and are never found). When the host knows every sequence
    // has q_per_seq queries, a division; otherwise a binary search (dependent reads).
    int seq = 0;
    if (q_per_seq > 0) {
        seq = token / q_per_seq;
    } else {
        int hi = num_seqs;
        while (hi - seq > 1) {
            const int mid = (seq + hi) >> 1;
            if (cu_seqlens_q[mid] <= token) seq = mid; else hi = mid;
        }
    }
    const int q_start = q_per_seq > 0 ? seq * q_per_seq : cu_seqlens_q[seq];
    const int q_len = q_per_seq > 0 ? q_per_seq : cu_seqlens_q[seq + 1] - q_start;
    const int visible = seq_lens[seq] - q_len + (token - q_start) + 1;  // causal: positions 0 .. visible - 1
    const int steps = (visible + kStep - 1) / kStep;
    const int per_split = (steps + num_splits - 1) / num_splits;
    const int first = split * per_split;
    const int count = max(0, min(steps, first + per_split) - first);
    const int* table = block_table + (i64)seq * table_stride;

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.0f, 0.0f};  // warpgroup 0's

    if (wg == 0) {  // scores, softmax, values 0 .. 255
        for (int i = 0; i < count; ++i) {
            const int step = first + i, t = i & 1;
            const u32 tile = base + kKV + t * kTile;
            bar_sync<kThreads>(kFull + t);
            if constexpr (Q_BF16 && CACHE_FP8) {
                if (i == 0) scale_log2 *= *q_scale_of;  // written before the first tile's arrival
            }
            float s[32];
#pragma unroll
            for (int k = 0; k < 32; ++k) s[k] = 0.0f;
            wgmma_fence();
#ifndef KERNELMUX_DIAG_SKIP_SCORES
            full_score_mmas<kMmaBf16>(s, base + kQ, tile);
#endif
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(s);

            // Softmax in log2 units over whole rows: this thread's 16 columns of each, then its quad's.
            const int position0 = step * kStep + 2 * quad;
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool live = position0 + 8 * j + (e & 1) < visible;
                    s[4 * j + e] = live ? s[4 * j + e] * scale_log2 : neg_inf();
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
                }
            }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m_run[r], mx[r]);
                alpha[r] = exp2_approx(m_run[r] - m_new);  // 0 at the first step (m_run = -inf)
                m_run[r] = m_new;
                l_run[r] *= alpha[r];
            }
            bar_sync<kThreads>(kPFree);  // warpgroup 1 has read the previous P
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float p0 = exp2_approx(s[4 * j + 2 * r] - m_run[r]);
                    const float p1 = exp2_approx(s[4 * j + 2 * r + 1] - m_run[r]);
                    l_run[r] += p0 + p1;
                    const int row = row0 + 8 * r;
                    *reinterpret_cast<u32*>(shared + kP + row * 128 + ((j ^ (row & 7)) << 4) + quad * 4) =
                        pack2<kMmaBf16>(p0, p1);
                }
            }
            if (quad == 0) {
                alpha_of[row0] = alpha[0];
                alpha_of[row0 + 8] = alpha[1];
            }
            fence_async_proxy();
            bar_arrive<kThreads>(kPReady);
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= alpha[0];
                o[4 * j + 1] *= alpha[0];
                o[4 * j + 2] *= alpha[1];
                o[4 * j + 3] *= alpha[1];
            }
            wgmma_fence();
#ifndef KERNELMUX_DIAG_SKIP_VALUES
            value_mmas<kMmaBf16>(o, base + kP, tile, 0);
#endif
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(o);
            bar_arrive<kThreads>(kEmpty + t);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
            l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
        }
        if (quad == 0) {
            sum_of[row0] = l_run[0];
            sum_of[row0 + 8] = l_run[1];
        }
    } else {  // loads, values 256 .. 511
        const int loader = tid - 128;
        // Cache blocks hold a multiple of 64 positions (the host checks), so a step is one block's
        // rows. Each step's block id is read a step before its tile load is issued, so the table
        // read is off the load's critical path.
        auto block_of = [&](int step) -> int {
            return step < first + count ? table[step * kStep / block_size] : 0;
        };
        auto load_step = [&](int step, i64 block, u32 tile) {
            const int position = step * kStep;
            const unsigned char* rows = kv + block * kv_stride_b + (i64)(position % block_size) * kv_stride_p;
            load_tile<128>(tile, rows, kv_stride_p, visible - position, loader);
        };
        auto fetch_step = [&](int step, i64 block, Bytes16 (&raw)[18]) {
            const int position = step * kStep;
            const unsigned char* rows = kv + block * kv_stride_b + (i64)(position % block_size) * kv_stride_p;
            fetch_fp8_tile(raw, rows, kv_stride_p, visible - position, loader);
        };
        load_tile<128>(base + kQ, q + ((i64)token * q_stride_t + (i64)head0 * q_stride_h) * 2, q_stride_h * 2,
                       num_heads - head0, loader);
        const int block0 = block_of(first), block1 = block_of(first + 1);
        int block_next = block_of(first + 2);  // the block of the load issued at the end of this iteration
        if constexpr (CACHE_FP8) {
            // Tiles arrive through registers: fetched at the top of the iteration before the one
            // that stores them (so a step's compute hides the loads), converted and stored once
            // warpgroup 0 is done with the tile.
            copy_commit();  // Q
            if (count > 0) {
                Bytes16 raw[18];
                fetch_step(first, block0, raw);
                if constexpr (Q_BF16) {
                    copy_wait<0>();  // this thread's chunks of Q, which are the ones it converts
                    const float q_scale =
                        q_tile_to_f16(base + kQ, loader, reinterpret_cast<u32*>(shared + kQMaxima));
                    if (loader == 0) *q_scale_of = q_scale;
                }
                store_fp8_tile(base + kKV, raw, loader);
                if (count > 1) {
                    fetch_step(first + 1, block1, raw);
                    store_fp8_tile(base + kKV + kTile, raw, loader);
                }
                copy_wait<0>();
                fence_async_proxy();
                bar_arrive<kThreads>(kFull);
                if (count > 1) bar_arrive<kThreads>(kFull + 1);
                bar_arrive<kThreads>(kPFree);
            }
        } else {
            if (count > 0) load_step(first, block0, base + kKV);
            copy_commit();
            if (count > 1) load_step(first + 1, block1, base + kKV + kTile);
            copy_commit();
            if (count > 0) {
                copy_wait<1>();  // Q and the first tile
                fence_async_proxy();
                bar_arrive<kThreads>(kFull);
                bar_arrive<kThreads>(kPFree);
            }
        }
        for (int i = 0; i < count; ++i) {
            const int step = first + i, t = i & 1;
            const u32 tile = base + kKV + t * kTile;
            const int block_after = block_of(step + 3);  // used one iteration later
            Bytes16 raw[CACHE_FP8 ? 18 : 1];
#ifndef KERNELMUX_DIAG_SKIP_LOADS
            if constexpr (CACHE_FP8) {
                if (i + 2 < count) fetch_step(step + 2, block_next, raw);
            }
#endif
            bar_sync<kThreads>(kPReady);
            const float alpha0 = alpha_of[row0], alpha1 = alpha_of[row0 + 8];
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= alpha0;
                o[4 * j + 1] *= alpha0;
                o[4 * j + 2] *= alpha1;
                o[4 * j + 3] *= alpha1;
            }
            wgmma_fence();
#ifndef KERNELMUX_DIAG_SKIP_VALUES
            value_mmas<kMmaBf16>(o, base + kP, tile, 1);
#endif
            wgmma_commit();
            if (!CACHE_FP8 && i + 1 < count) {
                copy_wait<0>();  // the next tile (the newest group)
                fence_async_proxy();
                bar_arrive<kThreads>(kFull + (t ^ 1));
            }
            wgmma_wait<0>();
            fence_registers(o);
            if (i + 1 < count) bar_arrive<kThreads>(kPFree);
            bar_sync<kThreads>(kEmpty + t);  // warpgroup 0 is done with this tile too
            if constexpr (CACHE_FP8) {
                if (i + 2 < count) {
#ifndef KERNELMUX_DIAG_SKIP_LOADS
                    store_fp8_tile(tile, raw, loader);
#endif
                    fence_async_proxy();
                    bar_arrive<kThreads>(kFull + t);  // step i + 2's tile (SKIP_LOADS: still announced)
                }
            } else {
#ifndef KERNELMUX_DIAG_SKIP_LOADS
                if (i + 2 < count) load_step(step + 2, block_next, tile);
#endif
            }
            block_next = block_after;
            copy_commit();
        }
    }
    __syncthreads();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r, head = head0 + row;
        if (head >= num_heads) continue;
        const float total = sum_of[row];
        const i64 flat = (i64)token * num_heads + head;
        if constexpr (CACHE_FP8) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j + 2 * r] *= value_scale;
                o[4 * j + 2 * r + 1] *= value_scale;
            }
        }
        if (part_acc != nullptr) {
            float* acc =
                part_acc + ((i64)split * num_tokens * num_heads + flat) * kRank + wg * 256 + 2 * quad;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                *reinterpret_cast<float2*>(acc + 8 * j) = make_float2(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
            if (wg == 0 && quad == 0) {
                const i64 stat = (i64)split * num_tokens * num_heads + flat;
                part_ml[stat] = m_run[r];
                part_ml[(i64)num_splits * num_tokens * num_heads + stat] = total;
            }
        } else {
            const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            unsigned char* row_out =
                out + ((i64)token * o_stride_t + (i64)head * o_stride_h + wg * 256 + 2 * quad) * 2;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                *reinterpret_cast<u32*>(row_out + 16 * j) =
                    pack2<Q_BF16>(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse);
            if (lse != nullptr && wg == 0 && quad == 0) lse[flat] = (m_run[r] + log2_approx(total)) * kLn2;
        }
    }
}
