// kernelmux cuda backend: fused_moe on Hopper (sm_90a) for 16-bit and 128-block fp8 (DeepSeek-V3) experts at
// prefill sizes.
//
// At T = 4096 the two grouped GEMMs are matmul-bound, and the triton kernels stop at 45-65% of the
// bf16 rate and 32% of the fp8 rate (perf/decisions/fused_moe.md). This file's GEMM gives each of three
// warpgroups one job, as the prefill kernel does (paged_prefill_sm90.cu); with B by TMA it measured
// 1.02-1.10x the triton kernels at T = 4096 in bf16, 1.31x with DeepSeek-V3's fp8 experts (the decision file
// says what else was measured and not kept).
//
//   - Routing (moe_route_sm90, one CTA): each (token, slot) pair placed in its local expert's run
//     of rows, each run padded to whole 128-row blocks: counts, padded starts and each block's
//     expert, then every pair scattered to a row of its run. No host sync: the GEMMs' grids are
//     bounds from host ints, and a tile past the routed rows is skipped.
//   - The grouped GEMM (moe_gemm_sm90): a CTA computes a 128-row block against two 128-wide column
//     tiles of one expert's weights: gate and up (gate-up: the same 128 columns of both halves of
//     w1, so the activation is the epilogue's) or two neighbouring tiles (down). Warpgroup 0 (the
//     producer) copies 64-wide K steps of the A rows with 16-byte cp.async (gate-up: gathered
//     through the routing, by token; down: the intermediate in run order; rows past the run are
//     zero-filled, never read) and of the 256 B rows by TMA into a ring of STAGES stages, each
//     tile 128 rows x 128 bytes in the 128-byte swizzled layout wgmma reads. Warpgroups 1 and 2
//     (the consumers) take 64 rows each: per step 8 wgmma m64n128k16 into two accumulators, the
//     step's group waited for one step later, when its stage is handed back.
//   - Epilogues: gate-up rounds gate and up to the hidden dtype, applies silu or gelu in fp32 and
//     stores the rounded product in run order (the spec's dataflow); down multiplies the router
//     weight in fp32 and stores each pair's row rounded (top-1: the output itself).
//   - fp8 experts (FP8): the same CTAs and ring, a K step of 128 codes (one scale block); each half's step
//     runs into a fresh accumulator promoted with its scales, and gate-up's epilogue stores the intermediate
//     quantized 1 x 128 (the kernel's comment says how).
//   - moe_sum_sm90: each token's k pair rows added in fp32 and rounded once; a slot routed to
//     another rank (never written) adds nothing.
//
// Hand-offs are mbarriers, two per stage: full completes when the producer's copies into the stage
// land (each producer thread's cp.async.mbarrier.arrive, and the TMA's bytes), empty when every
// consumer warp is done with it. Compiled at runtime by NVRTC for sm_90a; see fused_moe.py.

#include "moe_common.cuh"
#include "quantize_common.cuh"
#include "sm90_common.cuh"

namespace {

constexpr int kRows = 128;       // rows per routing block: the CTA's M, two consumer warpgroups of 64
constexpr int kCols = 128;       // columns per accumulator (the wgmma's N); a CTA has two
constexpr int kStepBytes = 128;  // K per pipeline step: one 128-byte row of a swizzled tile (64 or 128 elements)
constexpr int kScaleBlock = 128;  // fp8: a weight block's rows and columns, an activation group's columns
constexpr int kThreads = 384;    // producer + two consumers
constexpr int kTile = 128 * 128;  // 128 rows x 128 bytes
constexpr int kGroupBlocks = 8;  // row blocks that share each column tile while it is in L2
// 16-bit: the producer's 12 row pointers and its walk over tiles spilled at 72 (down, persistent loop). fp8: a
// consumer's step accumulator and scales need 216.
template <bool FP8> constexpr int kProducerRegisters = FP8 ? 72 : 88;
template <bool FP8> constexpr int kConsumerRegisters = FP8 ? 216 : 208;  // 128 x 72 + 256 x 216 <= 64K
constexpr int kRouteThreads = 1024;  // the routing CTA: one local expert per thread (E <= 1024)
constexpr int kSumThreads = 256, kSumVector = 8;  // moe_sum_sm90: 8 columns (16 bytes) a thread

// Shared memory from a 1024-byte aligned base (the swizzle repeats every 1024 bytes): STAGES x
// (A, B half 0, B half 1).
template <int STAGES>
__device__ constexpr int shared_bytes() { return STAGES * 3 * kTile + 1024; }

// 128 rows x 128 bytes of K (from byte `k_byte` of each row) into a swizzled tile, by the producer's
// 128 threads: thread t copies chunks t % 4 and t % 4 + 4 of rows t / 4 + 32 p. rows[p] is that
// row's source, or null for a row to zero-fill; chunks at or past `k_bytes` are zero-filled too
// (their copies read nothing but still name a valid address: `anywhere`).
__device__ __forceinline__ void load_tile(u32 tile, int tid, const unsigned char* anywhere,
                                          const unsigned char* const (&rows)[4], int k_byte, int k_bytes) {
    const int quarter = tid & 3, row = tid >> 2, low = row & 7;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int chunk = quarter + 4 * k, offset = k_byte + chunk * 16;
            const bool live = rows[p] != nullptr && offset < k_bytes;
            copy16(tile + (row + 32 * p) * 128 + ((chunk ^ low) << 4), live ? rows[p] + offset : anywhere,
                   live ? 16u : 0u);
        }
    }
}

}  // namespace

// The kernels' parameters are these structs' fields, in order: the host fills their mirrors
// (_params.py) and launches with a pointer to each of their fields; the host appends static_asserts
// holding each kernel's parameter list, its struct and the mirror to one list of types.
struct MoeRouteParams {
    const int* topk_ids;
    const int* expert_map;  // null: no map, the ids are local
    int* counts;
    int* starts;
    int* block_expert;
    int* sorted_pairs;
    int num_pairs, topk, num_experts, max_blocks;
    i64 ids_stride_t, ids_stride_k, map_stride;
};

struct MoeGemmParams {
    TensorMap b_map;         // w1 [E, 2I, H] or w2 [E, H, I] (TMA)
    const unsigned char* a;  // gate-up: hidden [T, H]; down: the intermediate [rows, I] (fp8: their codes)
    unsigned char* out;      // gate-up: the intermediate; down: [T * k, H] pair rows, or out [T, H] (top-1)
    const int* sorted_pairs;
    const int* block_expert;
    const int* starts;
    const int* counts;
    const float* topk_weights;
    const float* a_scale;    // fp8: a's group scales [T or rows, K / 128], rows a_scale_stride apart (else null)
    const float* b_scale;    // fp8: the weight's block scales [E, N / 128, K / 128] (else null)
    float* out_scale;        // fp8 gate-up: the intermediate's group scales [rows, I / 128] (else null)
    int topk, n_size, k_size, max_blocks;
    i64 a_stride, out_stride, weights_stride_t, weights_stride_k, a_scale_stride, b_scale_stride_e,
        b_scale_stride_n, b_scale_stride_k, out_scale_stride;
};

struct MoeSumParams {
    const unsigned char* pairs;
    const int* topk_ids;
    const int* expert_map;
    unsigned char* out;
    int hidden_size, topk;
    i64 pairs_stride, ids_stride_t, ids_stride_k, map_stride, out_stride;
};

// One CTA of 1024 threads. counts, starts: [num_experts]; block_expert: [max_blocks] (-1 past the last
// used block); sorted_pairs[row] = the pair in that row of its expert's run (rows of a run's padding are
// not written: the GEMMs stop at starts + counts).
__global__ void __launch_bounds__(kRouteThreads, 1) moe_route_sm90(
    const int* __restrict__ topk_ids, const int* __restrict__ expert_map, int* __restrict__ counts,
    int* __restrict__ starts, int* __restrict__ block_expert, int* __restrict__ sorted_pairs, int num_pairs,
    int topk, int num_experts, int max_blocks, i64 ids_stride_t, i64 ids_stride_k, i64 map_stride) {
    __shared__ int count[kRouteThreads], cursor[kRouteThreads], ends[kRouteThreads], warp_sums[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    count[tid] = 0;
    __syncthreads();
    for (int pair = tid; pair < num_pairs; pair += kRouteThreads) {
        const int expert = local_expert(topk_ids, expert_map, pair, topk, ids_stride_t, ids_stride_k, map_stride);
        if (expert >= 0) atomicAdd(&count[expert], 1);
    }
    __syncthreads();
    // Padded run lengths, scanned over the CTA: within each warp, then over the warps' sums.
    const int padded = tid < num_experts ? (count[tid] + kRows - 1) / kRows * kRows : 0;
    int end = padded;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int before = __shfl_up_sync(0xffffffffu, end, offset);
        if (lane >= offset) end += before;
    }
    if (lane == 31) warp_sums[warp] = end;
    __syncthreads();
    if (warp == 0) {
        int sum = warp_sums[lane];
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int before = __shfl_up_sync(0xffffffffu, sum, offset);
            if (lane >= offset) sum += before;
        }
        warp_sums[lane] = sum;
    }
    __syncthreads();
    if (warp > 0) end += warp_sums[warp - 1];
    const int rows = warp_sums[31];
    ends[tid] = end;
    cursor[tid] = end - padded;
    if (tid < num_experts) {
        counts[tid] = count[tid];
        starts[tid] = end - padded;
    }
    __syncthreads();
    // A block's expert: the first whose run ends past the block's first row.
    for (int block = tid; block < max_blocks; block += kRouteThreads) {
        const int row = block * kRows;
        int owner = -1;
        if (row < rows) {
            int lo = 0, hi = num_experts - 1;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (ends[mid] > row) hi = mid; else lo = mid + 1;
            }
            owner = lo;
        }
        block_expert[block] = owner;
    }
    for (int pair = tid; pair < num_pairs; pair += kRouteThreads) {
        const int expert = local_expert(topk_ids, expert_map, pair, topk, ids_stride_t, ids_stride_k, map_stride);
        if (expert >= 0) sorted_pairs[atomicAdd(&cursor[expert], 1)] = pair;
    }
}

// Grid: one CTA a tile (max_blocks x column tiles), or fewer that each take every gridDim.x-th tile
// (persistent); 384 threads, shared_bytes<STAGES>() of dynamic shared memory (and 16 STAGES bytes of static:
// the mbarriers). GATED (gate-up): n_size = I, k_size = H, a = hidden (rows gathered by token), out = the
// intermediate [rows, I] in run order; a CTA's accumulators are columns n0.. of gate (w1 rows n0..) and of up
// (w1 rows I + n0..). Otherwise (down): n_size = H, k_size = I, a = the intermediate, out = pair rows; the
// accumulators are columns n0.. and n0 + 128... b_map: w1 [E, 2I, H] or w2 [E, H, I] as (K, rows, expert),
// boxes of 64 x 128 x 1 in the 128-byte swizzle (fp8: 128 x 128 x 1). Sizes and strides in elements; rows
// 16-byte aligned, K a multiple of 8.
// FP8 (DeepSeek-V3's fp8_block): a and the weights are e4m3 codes, a K step is one 128-wide scale block, N and K
// multiples of 128. Each half's step goes into a fresh accumulator whose product is promoted into the tile's fp32
// sums with the step's scales, a's group scale of the row times the weight block's (scaled_mm_sm90.cu's scheme);
// gate-up's epilogue quantizes the intermediate itself: a CTA's 128 columns are one 1 x 128 group (codes into out,
// scales into out_scale), with quantize_fp8's arithmetic, so down reads codes and no pass quantizes them.
template <bool BF16, bool GATED, bool GELU, int STAGES, bool FP8>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_sm90(
    const __grid_constant__ TensorMap b_map, const unsigned char* __restrict__ a, unsigned char* __restrict__ out,
    const int* __restrict__ sorted_pairs, const int* __restrict__ block_expert, const int* __restrict__ starts,
    const int* __restrict__ counts, const float* __restrict__ topk_weights, const float* __restrict__ a_scale,
    const float* __restrict__ b_scale, float* __restrict__ out_scale, int topk, int n_size, int k_size,
    int max_blocks, i64 a_stride, i64 out_stride, i64 weights_stride_t, i64 weights_stride_k, i64 a_scale_stride,
    i64 b_scale_stride_e, i64 b_scale_stride_n, i64 b_scale_stride_k, i64 out_scale_stride) {
    constexpr int kElementBytes = FP8 ? 1 : 2, kStepK = kStepBytes / kElementBytes;
    // full: the producer's 128 threads' copies, and thread 0's arrival expecting the B tiles' bytes; empty:
    // the consumers' 8 warps.
    constexpr u32 kFullCount = 128 + 1, kEmptyCount = 8;
    __shared__ __align__(8) u64 barriers[2][STAGES];
    extern __shared__ unsigned char shared_raw[];
    u32 dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < (u32)shared_bytes<STAGES>()) __trap();  // the host launched it with too little

    // Tile t's row block, first column and expert: row blocks in groups of kGroupBlocks; within a group, a
    // column tile's blocks are consecutive tiles, so the CTAs running at once share it in L2. CTA b takes
    // tiles b, b + gridDim.x, ... (a grid of one CTA a tile, or persistent CTAs); a tile of a block past the
    // routed rows (expert -1) is skipped by the producer and the consumers alike.
    const int tile_width = GATED ? kCols : 2 * kCols;
    const int column_tiles = (n_size + tile_width - 1) / tile_width;
    const int num_tiles = max_blocks * column_tiles;
    auto place = [&](int tile, int& block_m, int& n0, int& expert) {
        const int group = tile / (kGroupBlocks * column_tiles), first_block = group * kGroupBlocks;
        const int group_blocks = min(max_blocks - first_block, kGroupBlocks);
        const int within = tile % (kGroupBlocks * column_tiles);
        block_m = first_block + within % group_blocks;
        n0 = within / group_blocks * tile_width;
        expert = block_expert[block_m];
        return expert >= 0;
    };

    const u32 base = shared_address(shared_raw);
    const u32 tiles = (base + 1023u) & ~1023u;
    auto a_tile = [&](int stage) { return tiles + (3 * stage) * kTile; };
    auto b_tile = [&](int stage, int half) { return tiles + (3 * stage + 1 + half) * kTile; };
    const u32 barrier_base = shared_address(&barriers[0][0]);
    auto full = [&](int stage) { return barrier_base + 8 * stage; };
    auto empty = [&](int stage) { return barrier_base + 8 * (STAGES + stage); };
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform as far as the compiler knows
    if (tid == 0) {
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(full(stage), kFullCount);
            mbarrier_init(empty(stage), kEmptyCount);
        }
    }
    __syncthreads();
    const int steps = (k_size + kStepK - 1) / kStepK;

    if (wg == 0) {  // the producer
        release_registers<kProducerRegisters<FP8>>();
        const int row = tid >> 2;
        int g = 0;  // steps this CTA has issued over its tiles: the ring's position (stage and phase)
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
            int block_m, n0, expert;
            if (!place(tile, block_m, n0, expert)) continue;
            const int row_base = block_m * kRows, run_end = starts[expert] + counts[expert];
            // This thread's four A rows (row + 32 p): their sources, fixed for the tile's steps.
            const unsigned char* a_rows[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int r = row_base + row + 32 * p;
                if (r >= run_end) {
                    a_rows[p] = nullptr;
                } else if constexpr (GATED) {
                    a_rows[p] = a + (i64)(sorted_pairs[r] / topk) * a_stride * kElementBytes;
                } else {
                    a_rows[p] = a + (i64)r * a_stride * kElementBytes;
                }
            }
            // The B tiles' first rows: gate-up's column n of gate is w1 row n, of up row I + n (gate's rows past
            // I read up's, for columns the epilogue drops); down's column n is w2 row n.
            const int b_row0 = n0, b_row1 = GATED ? n_size + n0 : n0 + kCols;
            // Step g's copies go out as soon as its stage is free and land on its full barrier by
            // themselves: every free stage is in flight (the next tile's too, under this one's epilogue),
            // and the producer never waits for a load.
            for (int i = 0; i < steps; ++i, ++g) {
                const int stage = g % STAGES;
                if (g >= STAGES) mbarrier_wait(empty(stage), (u32)(g / STAGES - 1) & 1u);
                if (tid == 0) {
                    mbarrier_arrive_expect_bytes(full(stage), 2 * kTile);
                    tma_load_3d(b_tile(stage, 0), b_map, i * kStepK, b_row0, expert, full(stage));
                    tma_load_3d(b_tile(stage, 1), b_map, i * kStepK, b_row1, expert, full(stage));
                }
                load_tile(a_tile(stage), tid, a, a_rows, i * kStepBytes, k_size * kElementBytes);
                copy_arrive(full(stage));
            }
        }
        copy_wait_all();  // nothing of this CTA's left in flight when its threads exit
        return;
    }

    // A consumer: rows 64 c .. 64 c + 63 of each block. This thread's accumulator rows are row0 and
    // row0 + 8 of those; its columns 8 j + 2 quad (+1) of each 8-column group j.
    claim_registers<kConsumerRegisters<FP8>>();
    const int c = wg - 1, lane = tid & 31, quad = lane & 3;
    const int row0 = accumulator_row(tid);
    int g = 0;  // the producer's count, step for step
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        int block_m, n0, expert;
        if (!place(tile, block_m, n0, expert)) continue;
        const int row_base = block_m * kRows, run_end = starts[expert] + counts[expert];
        float acc[2][64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = 0.0f;
        if constexpr (FP8) {
            // The scales of this thread's two rows (a row past the run reads the run's last: its sums are never
            // stored; every block holds at least one routed row) and of the two B tiles' weight blocks.
            const float* a_scales[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = min(row_base + 64 * c + row0 + 8 * r, run_end - 1);
                a_scales[r] = a_scale + (GATED ? (i64)(sorted_pairs[row] / topk) : (i64)row) * a_scale_stride;
            }
            const int b_rows = GATED ? 2 * n_size : n_size;  // down's second tile may lie past H: its block clamped
            const int b_row1 = min(GATED ? n_size + n0 : n0 + kCols, b_rows - 1);
            const float* expert_scales = b_scale + expert * b_scale_stride_e;
            const float* b_scales[2] = {expert_scales + (n0 / kScaleBlock) * b_scale_stride_n,
                                        expert_scales + (b_row1 / kScaleBlock) * b_scale_stride_n};
            // Step i's scales, loaded a step ahead (pinned: a load waited for in its own step stalls the promotion).
            float sa[2], sb[2];
            auto load_scales = [&](int step) {
#pragma unroll
                for (int r = 0; r < 2; ++r) sa[r] = load_scale(a_scales[r] + step);
#pragma unroll
                for (int h = 0; h < 2; ++h) sb[h] = load_scale(b_scales[h] + step * b_scale_stride_k);
            };
            load_scales(0);
            for (int i = 0; i < steps; ++i, ++g) {
                float scale[2][2];  // [half][row]
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    scale[h][0] = sa[0] * sb[h];
                    scale[h][1] = sa[1] * sb[h];
                }
                load_scales(min(i + 1, steps - 1));
                const int stage = g % STAGES;
                mbarrier_wait(full(stage), (u32)(g / STAGES) & 1u);
                fence_async_proxy();  // the A copies' writes (generic proxy), seen through the barrier, to the wgmmas
                const u64 a_desc = descriptor(a_tile(stage) + c * 64 * 128, 16, 1024);
                // The halves one after the other, each waited for and promoted (registers for one step's
                // accumulator): the other consumer's wgmmas run during a promotion.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float step_acc[64];
                    const u64 b_desc = descriptor(b_tile(stage, h), 16, 1024);
                    wgmma_fence();
#pragma unroll
                    for (int k = 0; k < kStepK / 32; ++k) {  // 32 bytes of K a wgmma: +2 in 16-byte units
                        mma_e4m3_m64n128k32(step_acc, a_desc + 2 * k, b_desc + 2 * k, k);
                    }
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_registers(step_acc);
                    if (h == 1) mbarrier_arrive_if(empty(stage), lane == 0);  // the stage goes back to the producer
#pragma unroll
                    for (int q = 0; q < 16; ++q) {
                        acc[h][4 * q] = fmaf(step_acc[4 * q], scale[h][0], acc[h][4 * q]);
                        acc[h][4 * q + 1] = fmaf(step_acc[4 * q + 1], scale[h][0], acc[h][4 * q + 1]);
                        acc[h][4 * q + 2] = fmaf(step_acc[4 * q + 2], scale[h][1], acc[h][4 * q + 2]);
                        acc[h][4 * q + 3] = fmaf(step_acc[4 * q + 3], scale[h][1], acc[h][4 * q + 3]);
                    }
                }
            }
        } else {
            for (int i = 0; i < steps; ++i, ++g) {
                const int stage = g % STAGES;
                mbarrier_wait(full(stage), (u32)(g / STAGES) & 1u);
                fence_async_proxy();  // the A copies' writes (generic proxy), seen through the barrier, to the wgmmas
                wgmma_fence();
                const u64 a_desc = descriptor(a_tile(stage) + c * 64 * 128, 16, 1024);
                const u64 b0_desc = descriptor(b_tile(stage, 0), 16, 1024);
                const u64 b1_desc = descriptor(b_tile(stage, 1), 16, 1024);
#pragma unroll
                for (int k = 0; k < kStepK / 16; ++k) {
                    mma_ss_m64n128k16<BF16>(acc[0], a_desc + 2 * k, b0_desc + 2 * k, 1);
                    mma_ss_m64n128k16<BF16>(acc[1], a_desc + 2 * k, b1_desc + 2 * k, 1);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the step before's MMAs are done: its stage goes back to the producer
                if (i > 0) mbarrier_arrive_if(empty((g - 1) % STAGES), lane == 0);
            }
            wgmma_wait<0>();
            fence_registers(acc[0]);
            fence_registers(acc[1]);
            mbarrier_arrive_if(empty((g - 1) % STAGES), lane == 0);  // the tile's last stage, for the next tile
        }

#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row_base + 64 * c + row0 + 8 * r;
            if constexpr (GATED && FP8) {
                // The row's group: gate and up rounded, the product rounded to the hidden dtype (what the spec
                // quantizes), its maximum over the quad's 128 columns (before any lane leaves: the shuffles need
                // the whole warp), then quantize_fp8's scale and codes.
                float x[32];
                u32 amax = 0;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    float g0 = acc[0][4 * j + 2 * r], g1 = acc[0][4 * j + 2 * r + 1];
                    float u0 = acc[1][4 * j + 2 * r], u1 = acc[1][4 * j + 2 * r + 1];
                    round2<BF16>(g0, g1);
                    round2<BF16>(u0, u1);
                    x[2 * j] = gated<GELU>(g0, u0);
                    x[2 * j + 1] = gated<GELU>(g1, u1);
                    round2<BF16>(x[2 * j], x[2 * j + 1]);
                    amax = max(amax, max(__float_as_uint(x[2 * j]) & 0x7fffffffu,
                                         __float_as_uint(x[2 * j + 1]) & 0x7fffffffu));
                }
                amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
                amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
                const float scale = scale_of<true, false>(__uint_as_float(amax));
                const Divisor divide = divisor<false, true>(scale);
                if (row >= run_end) continue;
                unsigned char* row_out = out + (i64)row * out_stride + n0 + 2 * quad;
#pragma unroll
                for (int j = 0; j < 16; ++j) {  // the sign bit ORed on: a quotient corrected to +0 keeps x's
                    const u32 code = e4m3x2(quotient<false, false>(x[2 * j], divide),
                                            quotient<false, false>(x[2 * j + 1], divide)) |
                                     (__float_as_uint(x[2 * j]) >> 24 & 0x80u) |
                                     (__float_as_uint(x[2 * j + 1]) >> 16 & 0x8000u);
                    *reinterpret_cast<u16*>(row_out + 8 * j) = (u16)code;
                }
                if (quad == 0) out_scale[(i64)row * out_scale_stride + n0 / kScaleBlock] = scale;
                continue;
            }
            if (row >= run_end) continue;
            if constexpr (GATED) {
                unsigned char* row_out = out + ((i64)row * out_stride + n0 + 2 * quad) * 2;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    if (n0 + 8 * j + 2 * quad >= n_size) continue;
                    float g0 = acc[0][4 * j + 2 * r], g1 = acc[0][4 * j + 2 * r + 1];
                    float u0 = acc[1][4 * j + 2 * r], u1 = acc[1][4 * j + 2 * r + 1];
                    round2<BF16>(g0, g1);
                    round2<BF16>(u0, u1);
                    *reinterpret_cast<u32*>(row_out + 16 * j) = pack2<BF16>(gated<GELU>(g0, u0), gated<GELU>(g1, u1));
                }
            } else {
                const int pair = sorted_pairs[row];
                const float weight = topk_weights[(i64)(pair / topk) * weights_stride_t +
                                                  (i64)(pair % topk) * weights_stride_k];
                unsigned char* row_out = out + ((i64)pair * out_stride + n0 + 2 * quad) * 2;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        if (n0 + half * kCols + 8 * j + 2 * quad >= n_size) continue;
                        *reinterpret_cast<u32*>(row_out + (half * kCols + 8 * j) * 2) =
                            pack2<BF16>(acc[half][4 * j + 2 * r] * weight, acc[half][4 * j + 2 * r + 1] * weight);
                    }
                }
            }
        }
    }
}

// Grid (T, ceil(H / 2048)), 256 threads: out[t, n..n+7] = the sum of the token's k pair rows there.
template <bool BF16>
__global__ void __launch_bounds__(kSumThreads) moe_sum_sm90(
    const unsigned char* __restrict__ pairs, const int* __restrict__ topk_ids, const int* __restrict__ expert_map,
    unsigned char* __restrict__ out, int hidden_size, int topk, i64 pairs_stride, i64 ids_stride_t,
    i64 ids_stride_k, i64 map_stride, i64 out_stride) {
    const int token = blockIdx.x, column = (blockIdx.y * kSumThreads + threadIdx.x) * kSumVector;
    if (column >= hidden_size) return;
    float sum[kSumVector] = {};
    for (int slot = 0; slot < topk; ++slot) {
        const int pair = token * topk + slot;
        if (local_expert(topk_ids, expert_map, pair, topk, ids_stride_t, ids_stride_k, map_stride) < 0) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(pairs + ((i64)pair * pairs_stride + column) * 2);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float lo, hi;
            unpack2<BF16>(words[w], lo, hi);
            sum[2 * w] += lo;
            sum[2 * w + 1] += hi;
        }
    }
    uint4 packed;
    packed.x = pack2<BF16>(sum[0], sum[1]);
    packed.y = pack2<BF16>(sum[2], sum[3]);
    packed.z = pack2<BF16>(sum[4], sum[5]);
    packed.w = pack2<BF16>(sum[6], sum[7]);
    *reinterpret_cast<uint4*>(out + ((i64)token * out_stride + column) * 2) = packed;
}
