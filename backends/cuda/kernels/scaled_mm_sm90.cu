// kernelmux cuda backend: scaled_mm on Hopper (sm_90a) with 128-block scales (DeepSeek-V3's 1 x 128 activation
// groups and 128 x 128 weight blocks), e4m3fn operands, at prefill sizes.
//
// At M = 4096 the triton kernel reaches 45% of the fp8 rate against DeepGEMM's 90% (perf/decisions/scaled_mm.md):
// its block scales multiply each 128-K product on the CUDA cores after a wgmma whose operands came by cp.async, with
// no TMA and no warp specialization, so the tensor cores wait on both. This kernel gives each of three warpgroups one
// job, as fused_moe_sm90.cu does:
//   - A CTA computes tiles of 128 x 128 or 256 x 128 (WAVES x 128 rows) of out, in 128-wide K steps: one scale block
//     of a and of b a step. CTAs are persistent (one an SM), so the loads of a CTA's next tile overlap the stores
//     of its last.
//   - Warpgroup 0 (the producer; one thread) loads each step's A and B tiles by TMA into a ring of STAGES stages, in
//     the 128-byte swizzle wgmma reads; out-of-bounds rows and K arrive as zeros.
//   - Warpgroups 1 and 2 (the consumers) take half the rows each, in waves of 64: per step and wave 4 wgmma
//     m64n128k32 (e4m3) into a fresh accumulator, waited for, then promoted on the CUDA cores into the tile's fp32
//     sums with the step's scales, scale_a of the thread's rows times scale_b of the tile's weight block (DeepGEMM's
//     scheme: the tensor cores' fp8 sums stay within one 128-K block). With one wave a consumer keeps two steps in
//     flight (step j + 1's wgmmas run while step j is promoted); with two there are registers for one, and the
//     other consumer's wgmmas run during a promotion. Scales are loaded a step or two ahead, by loads pinned in
//     place: a scale waited for in its own step cost 18% at M = 4096.
//   - The epilogue adds the bias in fp32 and rounds each output once.
// Tiles are ordered in groups of kGroupM row tiles, so the CTAs running at once share their B tiles in L2.
// Hand-offs are mbarriers, two per stage: full completes on the TMA's bytes, empty when the consumers' 8 warps
// are done with the stage. Compiled at runtime by NVRTC for sm_90a; see scaled_mm.py.

#include "sm90_common.cuh"

namespace {

constexpr int kTile = 128;                     // a tile's N, its K step (one scale block), a wave's rows
constexpr int kTileBytes = kTile * kTile;      // a wave's A or the B tile: 128 rows x 128 e4m3 bytes
constexpr int kThreads = 384;                  // producer + two consumers
constexpr int kGroupM = 8;                     // row tiles that share each column tile while it is in L2
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;  // 128 x 56 + 256 x 224 <= 64K

// Shared memory from a 1024-byte aligned base (the swizzle repeats every 1024 bytes): STAGES x (A, B), A of
// WAVES x 128 rows.
template <int STAGES, int WAVES>
__device__ constexpr int scaled_mm_shared_bytes() { return STAGES * (WAVES + 1) * kTileBytes + 1024; }

// OUT: 0 bf16, 1 fp16, 2 fp32. Element i of a vector of that dtype, as fp32.
template <int OUT>
__device__ __forceinline__ float load_out(const unsigned char* p, i64 i) {
    if constexpr (OUT == 2) {
        return reinterpret_cast<const float*>(p)[i];
    } else {
        float lo, hi;
        unpack2<OUT == 0>((u32)reinterpret_cast<const u16*>(p)[i], lo, hi);
        return lo;
    }
}

// Two neighbouring outputs of a row, the bias (`bias`: the first column's, `stride` elements apart; null: none)
// added in fp32 first; the first alone when `pair` is false (the last column of N).
template <int OUT>
__device__ __forceinline__ void store_pair(unsigned char* p, float v0, float v1, const unsigned char* bias, i64 stride,
                                           bool pair) {
    if (bias != nullptr) {
        v0 += load_out<OUT>(bias, 0);
        if (pair) v1 += load_out<OUT>(bias, stride);
    }
    if constexpr (OUT == 2) {
        if (pair) {
            *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
        } else {
            *reinterpret_cast<float*>(p) = v0;
        }
    } else {
        const u32 packed = pack2<OUT == 0>(v0, v1);
        if (pair) {
            *reinterpret_cast<u32*>(p) = packed;
        } else {
            *reinterpret_cast<u16*>(p) = (u16)packed;
        }
    }
}

// Tile `tile` of the grouped order: row tiles in groups of kGroupM, a column tile's row tiles consecutive, so the
// CTAs running at once share their B tiles in L2.
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tile_m, int& tile_n) {
    const int group = tile / (kGroupM * tiles_n), first_m = group * kGroupM;
    const int group_rows = min(tiles_m - first_m, kGroupM), within = tile % (kGroupM * tiles_n);
    tile_m = first_m + within % group_rows;
    tile_n = within / group_rows;
}

}  // namespace

// The kernel's parameters are this struct's fields, in order (named ABI: _params.py).
struct ScaledMmParams {
    TensorMap a_map;             // a [M, K] e4m3 as (K, M, 1): boxes of 128 x 128 WAVES x 1, 128-byte swizzle
    TensorMap b_map;             // b [N, K] e4m3 as (K, N, 1)
    const float* scale_a;        // [M, ceil(K / 128)] at (scale_a_stride_m, scale_a_stride_k)
    const float* scale_b;        // [ceil(N / 128), ceil(K / 128)] at (scale_b_stride_n, scale_b_stride_k)
    const unsigned char* bias;   // [N] in the output dtype at bias_stride, or null
    unsigned char* out;          // [M, N] in the output dtype, rows out_stride elements apart
    int m, n, k;
    i64 scale_a_stride_m, scale_a_stride_k, scale_b_stride_n, scale_b_stride_k, bias_stride, out_stride;
};

// Grid: up to one CTA an SM, each taking tiles blockIdx.x, + gridDim.x, ... (persistent: the producer loads the next
// tile's stages while the consumers store the last one); 384 threads, scaled_mm_shared_bytes<STAGES, WAVES>() of
// dynamic shared memory (and the static mbarriers). A tile is WAVES x 128 rows by 128 columns. K is a multiple of 16
// (TMA's 16-byte strides); N even.
template <int OUT, int STAGES, int WAVES>
__global__ void __launch_bounds__(kThreads, 1) scaled_mm_sm90(
    const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
    const float* __restrict__ scale_a, const float* __restrict__ scale_b, const unsigned char* __restrict__ bias,
    unsigned char* __restrict__ out, int m, int n, int k, i64 scale_a_stride_m, i64 scale_a_stride_k,
    i64 scale_b_stride_n, i64 scale_b_stride_k, i64 bias_stride, i64 out_stride) {
    constexpr u32 kFullCount = 1, kEmptyCount = 8;  // the producer's expect_tx arrival; the consumers' 8 warps
    constexpr int kOutBytes = OUT == 2 ? 4 : 2;
    constexpr int kBlockM = WAVES * kTile, kStageBytes = (WAVES + 1) * kTileBytes;
    constexpr int kRows = 2 * WAVES;  // a consumer thread's accumulator rows in a tile
    __shared__ __align__(8) u64 barriers[2][STAGES];
    extern __shared__ unsigned char shared_raw[];
    u32 dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < (u32)scaled_mm_shared_bytes<STAGES, WAVES>()) __trap();  // the host launched too little

    const int tiles_m = (m + kBlockM - 1) / kBlockM, tiles_n = (n + kTile - 1) / kTile, tiles = tiles_m * tiles_n;
    const int steps = (k + kTile - 1) / kTile;
    const u32 base = shared_address(shared_raw);
    const u32 tile_base = (base + 1023u) & ~1023u;
    auto a_tile = [&](int stage) { return tile_base + stage * kStageBytes; };
    auto b_tile = [&](int stage) { return tile_base + stage * kStageBytes + WAVES * kTileBytes; };
    const u32 barrier_base = shared_address(&barriers[0][0]);
    auto full = [&](int stage) { return barrier_base + 8 * stage; };
    auto empty = [&](int stage) { return barrier_base + 8 * (STAGES + stage); };
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform as far as the compiler knows
    if (tid == 0) {
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(full(stage), kFullCount);
            mbarrier_init(empty(stage), kEmptyCount);
        }
    }
    __syncthreads();

    // Steps are counted across the CTA's tiles (`it`): the ring and its parities run on from tile to tile.
    if (wg == 0) {
        release_registers<kProducerRegisters>();
        if (tid == 0) {  // the tiles: every free stage in flight, never waiting for a load
            for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x) {
                int tile_m, tile_n;
                tile_coords(tile, tiles_m, tiles_n, tile_m, tile_n);
                for (int i = 0; i < steps; ++i, ++it) {
                    const int stage = it % STAGES;
                    if (it >= STAGES) mbarrier_wait(empty(stage), (u32)(it / STAGES - 1) & 1u);
                    mbarrier_arrive_expect_bytes(full(stage), kStageBytes);
                    tma_load_3d(a_tile(stage), a_map, i * kTile, tile_m * kBlockM, 0, full(stage));
                    tma_load_3d(b_tile(stage), b_map, i * kTile, tile_n * kTile, 0, full(stage));
                }
            }
        }
        return;
    }

    // A consumer: rows 64 WAVES c .. 64 WAVES (c + 1) - 1 of each tile, in waves of 64 (one m64 wgmma each). This
    // thread's accumulator rows are row_lo and row_lo + 8 of each wave; its columns 8 j + 2 quad (+1) of each
    // 8-column group j.
    claim_registers<kConsumerRegisters>();
    const int c = wg - 1, quad = lane & 3, row_lo = 64 * WAVES * c + accumulator_row(tid);
    // A tile's scales at step 0: scale_b of the column tile, then scale_a of this thread's rows (wave w's at 2 w and
    // 2 w + 1). Rows past M read row M - 1's (their outputs are never stored).
    struct Scales { const float* b; const float* rows[kRows]; };
    auto tile_scales = [&](int tile_m, int tile_n) {
        Scales s;
        s.b = scale_b + (i64)tile_n * scale_b_stride_n;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int row = tile_m * kBlockM + row_lo + 64 * (r / 2) + 8 * (r % 2);
            s.rows[r] = scale_a + (i64)min(row, m - 1) * scale_a_stride_m;
        }
        return s;
    };
    int tile = blockIdx.x, tile_m, tile_n, next_m, next_n;
    tile_coords(min(tile, tiles - 1), tiles_m, tiles_n, tile_m, tile_n);
    Scales scales = tile_scales(tile_m, tile_n), next_scales = scales;
    // Step j's scales (b, then the rows') into raw: this tile's, or past its last step the CTA's next tile's (step
    // j - steps; clamped to its last, a load never used, when there is one step a tile).
    auto load_scales = [&](float (&raw)[1 + kRows], int j) {
        const bool next = j >= steps;
        const Scales from = next ? next_scales : scales;  // by value: a reference would put both in local memory
        const i64 step = min(next ? j - steps : j, steps - 1);
        raw[0] = load_scale(from.b + step * scale_b_stride_k);
#pragma unroll
        for (int r = 0; r < kRows; ++r) raw[1 + r] = load_scale(from.rows[r] + step * scale_a_stride_k);
    };
    auto products = [&](const float (&raw)[1 + kRows], float (&prod)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) prod[r] = raw[1 + r] * raw[0];
    };
    // Wave w's 4 wgmmas of the stage into step_acc, committed as one group.
    auto issue_wave = [&](float (&step_acc)[64], int stage, int w) {
        wgmma_fence();
        const u64 a_desc = descriptor(a_tile(stage) + (WAVES * c + w) * 64 * kTile, 16, 1024);
        const u64 b_desc = descriptor(b_tile(stage), 16, 1024);
#pragma unroll
        for (int kk = 0; kk < kTile / 32; ++kk) {  // 32 bytes of K a wgmma: +2 in the descriptor's 16-byte units
            mma_e4m3_m64n128k32(step_acc, a_desc + 2 * kk, b_desc + 2 * kk, kk);
        }
        wgmma_commit();
    };
    // A wave's finished product into acc (from acc[64 w]) with its rows' scales.
    float acc[64 * WAVES];
    auto promote = [&](const float (&step_acc)[64], int w, float s_lo, float s_hi) {
#pragma unroll
        for (int q = 0; q < 16; ++q) {
            acc[64 * w + 4 * q] = fmaf(step_acc[4 * q], s_lo, acc[64 * w + 4 * q]);
            acc[64 * w + 4 * q + 1] = fmaf(step_acc[4 * q + 1], s_lo, acc[64 * w + 4 * q + 1]);
            acc[64 * w + 4 * q + 2] = fmaf(step_acc[4 * q + 2], s_hi, acc[64 * w + 4 * q + 2]);
            acc[64 * w + 4 * q + 3] = fmaf(step_acc[4 * q + 3], s_hi, acc[64 * w + 4 * q + 3]);
        }
    };
    int it = 0;  // the CTA's steps before this tile's
    float step0[64], raw0[1 + kRows], prod0[kRows];
    [[maybe_unused]] float step1[64], raw1[1 + kRows], prod1[kRows];
    load_scales(raw0, 0);
    if constexpr (WAVES == 1) load_scales(raw1, 1);
    for (; tile < tiles; tile += gridDim.x) {
        // The CTA's next tile (this one again after the last), whose first steps' scales this tile's last load.
        tile_coords(min(tile + (int)gridDim.x, tiles - 1), tiles_m, tiles_n, next_m, next_n);
        next_scales = tile_scales(next_m, next_n);
#pragma unroll
        for (int i = 0; i < 64 * WAVES; ++i) acc[i] = 0.0f;
        if constexpr (WAVES == 1) {
            // Two steps in flight, in two accumulators: step j + 1's wgmmas run while step j is promoted, so the
            // tensor cores never wait on a promotion. Each step's scales are loaded two steps ahead (raw), into the
            // slot of its accumulator, and multiplied (prod) when the step is issued.
            auto issue = [&](float (&step_acc)[64], float (&raw)[1 + kRows], float (&prod)[kRows], int j) {
                products(raw, prod);
                load_scales(raw, j + 2);
                const int stage = (it + j) % STAGES;
                mbarrier_wait(full(stage), (u32)((it + j) / STAGES) & 1u);
                issue_wave(step_acc, stage, 0);
            };
            // Step j's wgmmas are done: its stage goes back to the producer, its product into acc.
            auto retire = [&](float (&step_acc)[64], const float (&prod)[kRows], int j) {
                fence_registers(step_acc);
                mbarrier_arrive_if(empty((it + j) % STAGES), lane == 0);
                promote(step_acc, 0, prod[0], prod[1]);
            };
            issue(step0, raw0, prod0, 0);
            int i = 0;
            for (; i + 2 < steps; i += 2) {  // steps i (in step0) and i + 1 (in step1), with i + 2 to come
                issue(step1, raw1, prod1, i + 1);
                wgmma_wait<1>();
                retire(step0, prod0, i);
                issue(step0, raw0, prod0, i + 2);
                wgmma_wait<1>();
                retire(step1, prod1, i + 1);
            }
            if (i + 1 < steps) {  // the last two
                issue(step1, raw1, prod1, i + 1);
                wgmma_wait<1>();
                retire(step0, prod0, i);
                wgmma_wait<0>();
                retire(step1, prod1, i + 1);
            } else {
                wgmma_wait<0>();
                retire(step0, prod0, i);
            }
            if ((steps & 1) && steps > 1) {  // the next tile's step 0 went to raw1 and its step 1 to raw0
#pragma unroll
                for (int q = 0; q < 1 + kRows; ++q) {
                    const float swapped = raw0[q];
                    raw0[q] = raw1[q];
                    raw1[q] = swapped;
                }
            }
        } else {
            // The tile's accumulators leave registers for one step accumulator only: a step's waves run one after
            // the other, each promoted as it finishes, while the other consumer's wgmmas run. Each step's scales
            // are loaded a step ahead.
            for (int i = 0; i < steps; ++i) {
                products(raw0, prod0);
                load_scales(raw0, i + 1);
                const int stage = (it + i) % STAGES;
                mbarrier_wait(full(stage), (u32)((it + i) / STAGES) & 1u);
#pragma unroll
                for (int w = 0; w < WAVES; ++w) {
                    issue_wave(step0, stage, w);
                    wgmma_wait<0>();
                    fence_registers(step0);
                    if (w == WAVES - 1) mbarrier_arrive_if(empty(stage), lane == 0);
                    promote(step0, w, prod0[2 * w], prod0[2 * w + 1]);
                }
            }
        }
        it += steps;

        const int n0 = tile_n * kTile;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int row = tile_m * kBlockM + row_lo + 64 * (r / 2) + 8 * (r % 2);
            if (row >= m) continue;
            unsigned char* row_out = out + ((i64)row * out_stride + n0 + 2 * quad) * kOutBytes;
            const float* row_acc = acc + 64 * (r / 2) + 2 * (r % 2);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int col = n0 + 8 * j + 2 * quad;
                if (col >= n) continue;
                const unsigned char* bias_at = bias == nullptr ? nullptr : bias + (i64)col * bias_stride * kOutBytes;
                store_pair<OUT>(row_out + 8 * j * kOutBytes, row_acc[4 * j], row_acc[4 * j + 1], bias_at, bias_stride,
                                col + 1 < n);
            }
        }
        tile_m = next_m;
        tile_n = next_n;
        scales = next_scales;
    }
}
