// kernelmux cuda backend: paged-attention prefill on Hopper (sm_90a) over 16-bit caches, head dim 128.
//
// Prefill is matmul-bound (2 x 128 FLOPs per query, position and head for q . k and p . v): the
// triton kernel's mma.sync dots stop at about 50% of the bf16 rate because nothing overlaps one
// tile's softmax with another's MMAs inside an SM. This kernel puts both products on warpgroup
// MMAs (wgmma) and gives each of three warpgroups one job (FlashAttention-3's division of labour,
// written from scratch on the MLA kernel's machinery, mla_decode_sm90.cu):
//
//   - One CTA takes 128 queries of one sequence and one query head, and walks the KV positions
//     they see in 128-position steps. Query tile and STAGES K and V tiles (128 rows x 256 bytes
//     each) live in shared memory in the layout wgmma reads: two 64-dim column blocks of
//     128 rows x 128 bytes, each row's 16-byte chunks swizzled by the row's low three bits.
//   - Warpgroup 0 (the producer) gathers the tiles through the block table with 16-byte cp.async
//     copies (positions past the sequence are zero-filled, never read: unread slots may hold
//     NaN) into a ring of STAGES steps. It gives up registers (setmaxnreg) to the consumers.
//   - Warpgroups 1 and 2 (the consumers) take 64 query rows each: S = Q K^T (8 wgmma
//     m64n128k16, both operands from shared memory), the online softmax on their own rows in
//     registers, then O += P V (8 wgmma m64n128k16, P from registers as the A operand, V read
//     N-major from its tile). Without PINGPONG the two consumers run unsynchronized, so one's
//     softmax overlaps the other's MMAs when they happen to fall out of step.
//   - Hand-offs are mbarriers, four per stage: K full and V full complete when the producer's
//     copies into the stage land (each producer thread's cp.async.mbarrier.arrive fires once its
//     copies have; the producer itself never waits for a load, so every free stage is in flight),
//     K empty and V empty when every consumer warp is done reading that tile (K after the
//     scores, V after the values, so the next K copies start a softmax earlier). Named barriers,
//     the first versions' hand-off, can only say a step landed by a thread that waited for it:
//     the producer then kept about one step in flight.
//   - OVERLAP: each consumer issues step i + 1's scores before waiting for step i's P V, so the
//     softmax of step i + 1 runs under the value MMAs of step i (FlashAttention-3's
//     intra-warpgroup overlap); O's rescale waits for the MMAs. PINGPONG (with OVERLAP): the two
//     consumers take turns to issue their MMAs, so one's softmax runs while the other's MMAs do
//     (FlashAttention-3's inter-warpgroup ping-pong).
//
// Masks (causal diagonal, sliding window, the sequence's end) are applied only on the steps that
// cross one; soft cap is a template flag (it touches every score); sinks join the denominator at
// the end. Compiled at runtime by NVRTC for sm_90a (wgmma and setmaxnreg are arch-specific);
// see _paged_prefill.py.

#include "sm90_common.cuh"

namespace {

constexpr int kDim = 128;         // head dim
constexpr int kRows = 128;        // query rows per CTA: two consumer warpgroups of 64 (the wgmma M)
constexpr int kStep = 128;        // KV positions per step (the score wgmma's N)
constexpr int kThreads = 384;     // producer + two consumers
constexpr int kColumnBlock = 128 * 128;            // 128 rows x 128 bytes (64 dims)
constexpr int kTile = kDim / 64 * kColumnBlock;    // a 128 x 128 16-bit tile: 32 KiB
constexpr int kProducerRegisters = 72, kConsumerRegisters = 216;  // 128 x 72 + 256 x 216 <= 64K, no spills

// Shared memory from a 1024-byte aligned base (the swizzle repeats every 1024 bytes): Q, then
// STAGES pairs of K and V tiles.
template <int STAGES>
__device__ constexpr int shared_bytes() { return (1 + 2 * STAGES) * kTile + 1024; }

// 128 rows x 256 bytes into a tile, by the producer's 128 threads: thread t copies chunks
// t % 4 + 4 k (k < 4) of rows t / 4 + 32 p (p < 4), so it needs four rows' addresses a tile (one
// block-table entry each, read a step ahead: per-row lookups on the copies' critical path held
// the first version to 38% of the matmul rate) and a warp covers eight rows' 64-byte runs a copy.
// The row's low three bits are (t / 4) % 8 for every p, so the swizzled destinations are two
// per-thread offsets plus constants. rows[p] is row t / 4 + 32 p's source, or null for a row to
// zero-fill (its copies read nothing but still name a valid address: `anywhere`).
__device__ __forceinline__ void load_tile(u32 tile, int tid, const unsigned char* anywhere,
                                          const unsigned char* const (&rows)[4]) {
    const int quarter = tid & 3, row = tid >> 2, low = row & 7;
    const u32 dst = tile + row * 128;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int chunk = quarter + 4 * k;
            copy16(dst + p * 32 * 128 + (k >> 1) * kColumnBlock + (((chunk & 7) ^ low) << 4),
                   rows[p] != nullptr ? rows[p] + chunk * 16 : anywhere, rows[p] != nullptr ? 16u : 0u);
        }
    }
}

}  // namespace

// The kernel's parameters are this struct's fields, in order: the host fills its mirror
// (_params.PagedPrefillParams) and launches with a pointer to each of its fields; the host appends static_asserts
// holding the kernel's parameter list, this struct and the mirror to one list of types.
struct PagedPrefillParams {
    const unsigned char* query;
    const unsigned char* k_cache;
    const unsigned char* v_cache;
    unsigned char* out;
    const int* cu_seqlens_q;
    const int* block_table;
    const int* seq_lens;
    const float* sinks;
    int group, page_shift, causal, window;
    float scale_log2, soft_cap;
    i64 q_stride_t, q_stride_h, o_stride_t, o_stride_h;
    i64 k_stride_b, k_stride_p, k_stride_h;
    i64 v_stride_b, v_stride_p, v_stride_h;
    i64 table_stride;
};

// Grid (Hq, ceil(max_query_len / 128), B), 384 threads, shared_bytes<STAGES>() of dynamic shared
// memory (and 32 STAGES bytes of static: the mbarriers). Query tile y of a sequence is launched
// as y' = gridDim.y - 1 - y, so the causal diagonal's longest tiles start first. Strides are in
// elements. page_shift = log2(block_size). scale_log2 = scale * log2(e), or scale / soft_cap with
// SOFT_CAP. window: W > 0, or 0 for none.
template <bool Q_BF16, bool SOFT_CAP, int STAGES, bool OVERLAP, bool PINGPONG>
__global__ void __launch_bounds__(kThreads, 1) paged_prefill_sm90(
    const unsigned char* __restrict__ query, const unsigned char* __restrict__ k_cache,
    const unsigned char* __restrict__ v_cache, unsigned char* __restrict__ out,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    const float* __restrict__ sinks, int group, int page_shift, int causal, int window, float scale_log2,
    float soft_cap, i64 q_stride_t, i64 q_stride_h, i64 o_stride_t, i64 o_stride_h, i64 k_stride_b,
    i64 k_stride_p, i64 k_stride_h, i64 v_stride_b, i64 v_stride_p, i64 v_stride_h, i64 table_stride) {
    // mbarriers per stage: K / V landed (one arrival per producer thread, made by its copies),
    // K / V free again (one arrival per consumer warp).
    static_assert(!PINGPONG || OVERLAP, "ping-pong is written for the overlapped loop");
    wait_for_previous_grid();  // launched overlapping the previous kernel (_paged_prefill.py): its writes first
    constexpr u32 kFullCount = 128, kEmptyCount = 8;
    __shared__ __align__(8) u64 barriers[4][STAGES];
    extern __shared__ unsigned char shared_raw[];
    u32 dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < (u32)shared_bytes<STAGES>()) __trap();  // the host launched it with too little
    const u32 base = shared_address(shared_raw);
    const u32 q_tile = (base + 1023u) & ~1023u;
    auto k_tile = [&](int stage) { return q_tile + (1 + 2 * stage) * kTile; };
    auto v_tile = [&](int stage) { return q_tile + (2 + 2 * stage) * kTile; };
    const u32 barrier_base = shared_address(&barriers[0][0]);
    auto k_full = [&](int stage) { return barrier_base + 8 * (0 * STAGES + stage); };
    auto v_full = [&](int stage) { return barrier_base + 8 * (1 * STAGES + stage); };
    auto k_empty = [&](int stage) { return barrier_base + 8 * (2 * STAGES + stage); };
    auto v_empty = [&](int stage) { return barrier_base + 8 * (3 * STAGES + stage); };

    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform as far as the compiler knows
    const int head = blockIdx.x, seq = blockIdx.z;
    const int kv_head = head / group;
    const int q_start = cu_seqlens_q[seq], q_len = cu_seqlens_q[seq + 1] - q_start;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * kRows;  // this CTA's first query of the sequence
    if (m0 >= q_len) return;  // the whole CTA, before any barrier
    if (tid == 0) {
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(k_full(stage), kFullCount);
            mbarrier_init(v_full(stage), kFullCount);
            mbarrier_init(k_empty(stage), kEmptyCount);
            mbarrier_init(v_empty(stage), kEmptyCount);
        }
    }
    __syncthreads();
    const int kv_len = seq_lens[seq];
    // Query i of the sequence sits at position context + i (causal); it sees positions
    // [context + i - window + 1, context + i] (window), [0, context + i] (causal), or all.
    const int context = kv_len - q_len;
    const int rows = min(kRows, q_len - m0);
    const int hi = causal ? min(kv_len, context + m0 + rows) : kv_len;  // positions [lo, hi) are read
    const int lo = window > 0 ? max(0, context + m0 - window + 1) : 0;
    const int first = lo / kStep, steps = hi > lo ? (hi + kStep - 1) / kStep - first : 0;

    if (wg == 0) {  // the producer
        release_registers<kProducerRegisters>();
        const int* table = block_table + (i64)seq * table_stride;
        const int block_mask = (1 << page_shift) - 1, row = tid >> 2;
        // This thread's four rows' cache blocks for a step (0 past the sequence: never used).
        auto blocks_of = [&](int step, int (&blocks)[4]) {
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int position = step * kStep + row + 32 * p;
                blocks[p] = position < kv_len ? table[position >> page_shift] : 0;
            }
        };
        auto kv_rows = [&](const unsigned char* cache, i64 stride_b, i64 stride_p, i64 stride_h, int step,
                           const int (&blocks)[4], const unsigned char* (&rows)[4]) {
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int position = step * kStep + row + 32 * p;
                rows[p] = position < kv_len ? cache + ((i64)blocks[p] * stride_b + (i64)(position & block_mask) *
                                                       stride_p + kv_head * stride_h) * 2
                                            : nullptr;
            }
        };
        int blocks[4], next_blocks[4];
        if (steps > 0) blocks_of(first, next_blocks);
        // Step i's copies go out as soon as its stage is free (its K and V halves each as soon as
        // the consumers are done with that half), and land on the stage's full barriers by
        // themselves: every free stage is in flight, and the producer never waits for a load.
        for (int i = 0; i < steps; ++i) {
            const int stage = i % STAGES, step = first + i;
            const u32 reuse = (u32)(i / STAGES - 1) & 1u;  // the empty phase that frees the stage
#pragma unroll
            for (int p = 0; p < 4; ++p) blocks[p] = next_blocks[p];
            if (i + 1 < steps) blocks_of(step + 1, next_blocks);  // used an iteration later
            const unsigned char* sources[4];
            if (i == 0) {  // the query tile lands with step 0's keys
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const int r = row + 32 * p;
                    sources[p] = r < rows ? query + ((i64)(q_start + m0 + r) * q_stride_t + (i64)head * q_stride_h) * 2
                                          : nullptr;
                }
                load_tile(q_tile, tid, query, sources);
            }
            kv_rows(k_cache, k_stride_b, k_stride_p, k_stride_h, step, blocks, sources);
            if (i >= STAGES) mbarrier_wait(k_empty(stage), reuse);
            load_tile(k_tile(stage), tid, query, sources);
            copy_arrive(k_full(stage));
            kv_rows(v_cache, v_stride_b, v_stride_p, v_stride_h, step, blocks, sources);
            if (i >= STAGES) mbarrier_wait(v_empty(stage), reuse);
            load_tile(v_tile(stage), tid, query, sources);
            copy_arrive(v_full(stage));
        }
        copy_wait_all();  // nothing of this CTA's left in flight when its threads exit
        return;
    }

    // A consumer: query rows 64 c .. 64 c + 63 of the tile. This thread's accumulator rows are
    // row0 and row0 + 8 of those; its columns 8 j + 2 quad (+1) of each 8-column group j.
    claim_registers<kConsumerRegisters>();
    const int c = wg - 1, lane = tid & 31, quad = lane & 3;
    const int row0 = accumulator_row(tid);
    const int first_row = m0 + 64 * c;  // the warpgroup's first query of the sequence
    int position_of[2];                 // this thread's rows' own positions (causal)
#pragma unroll
    for (int r = 0; r < 2; ++r) position_of[r] = context + first_row + row0 + 8 * r;
    // Steps whose positions all lie inside every row's range of this warpgroup need no mask.
    const int full_hi = min(kv_len, causal ? context + first_row + 1 : kv_len);  // [.., full_hi) seen by all rows
    const int full_lo = window > 0 ? context + first_row + 63 - window + 1 : 0;  // [full_lo, ..) likewise

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.0f, 0.0f};
    const u64 q_desc = descriptor(q_tile + c * 64 * 128, 16, 1024);

    // Step i's K / V tile has landed: the copies' writes (generic proxy), seen through the
    // barrier, made visible to the wgmmas (async proxy).
    auto wait_keys = [&](int i) {
        mbarrier_wait(k_full(i % STAGES), (u32)(i / STAGES) & 1u);
        fence_async_proxy();
    };
    auto wait_values = [&](int i) {
        mbarrier_wait(v_full(i % STAGES), (u32)(i / STAGES) & 1u);
        fence_async_proxy();
    };
    // PINGPONG: the consumers take turns to issue their MMAs (named barriers kTurn + c, each a
    // sync by consumer c and an arrive by the other), so one's MMAs run back to back while the
    // other computes its softmax. Consumer 1 starts by handing consumer 0 the first turn and
    // hands over no turn after its last, so every barrier's arrivals match its syncs.
    constexpr int kTurn = 1;
    auto take_turn = [&] {
        if constexpr (PINGPONG) bar_sync<256>(kTurn + c);
    };
    auto pass_turn = [&](bool last) {
        if constexpr (PINGPONG) bar_arrive_if<256>(kTurn + (c ^ 1), !(last && c == 1));
    };
    // s = Q K^T of step i (issued, not waited for).
    auto issue_scores = [&](float (&s)[64], int i) {
        const int stage = i % STAGES;
        wgmma_fence();
        const u64 k_desc = descriptor(k_tile(stage), 16, 1024);
#pragma unroll
        for (int k = 0; k < kDim / 16; ++k) {
            const u64 offset = ((k >> 2) * kColumnBlock + (k & 3) * 32) >> 4;
            mma_ss_m64n128k16<Q_BF16>(s, q_desc + offset, k_desc + offset, k);
        }
        wgmma_commit();
    };
    // o += P V of step i (issued, not waited for).
    auto issue_values = [&](const u32 (&p)[kStep / 16][4], int i) {
        const int stage = i % STAGES;
        wgmma_fence();
        const u64 v_desc = descriptor(v_tile(stage), kColumnBlock, 1024);
#pragma unroll
        for (int k = 0; k < kStep / 16; ++k) mma_rs_m64n128k16<Q_BF16>(o, p[k], v_desc + ((k * 16 * 128) >> 4));
        wgmma_commit();
    };
    // Step i's scores (landed in s) -> unnormalized probabilities in s, in place: log2 units,
    // soft cap, the masks where the step crosses a boundary, the running max and sum updated;
    // alpha gets the factor the accumulator must be rescaled by.
    auto softmax = [&](float (&s)[64], int i, float (&alpha)[2]) {
        // Without a soft cap the scores stay raw until the exponent, which folds the scale in
        // (one FFMA a score instead of a multiply and a subtraction): the host passes scale > 0,
        // so the raw maximum is the scaled one's. With a cap they are capped in log2 units first.
        float unit = scale_log2;
        if constexpr (SOFT_CAP) {
            unit = 1.0f;
#pragma unroll
            for (int k = 0; k < 64; ++k) {
                // cap * tanh(x), tanh from one exp2 of -2|x|: no overflow for any x.
                const float x = s[k] * scale_log2;
                const float e = exp2_approx(fabsf(x) * (-2.0f * kLog2e));
                const float t = (1.0f - e) / (1.0f + e);
                s[k] = (x < 0.0f ? -t : t) * (soft_cap * kLog2e);
            }
        }
        const int step_lo = (first + i) * kStep, step_hi = step_lo + kStep;
        if (step_hi > full_hi || step_lo < full_lo) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int position = step_lo + 8 * j + 2 * quad + (e & 1), own = position_of[e >> 1];
                    const bool live = position < kv_len && (!causal || position <= own) &&
                                      (window <= 0 || position > own - window);
                    if (!live) s[4 * j + e] = neg_inf();
                }
            }
        }
        // Maxima and sums in two interleaved chains per row (half the dependent latency).
        float mx[2][2] = {{neg_inf(), neg_inf()}, {neg_inf(), neg_inf()}};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1][j & 1] = fmaxf(mx[e >> 1][j & 1], s[4 * j + e]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float row_max = fmaxf(mx[r][0], mx[r][1]);
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
            const float m_new = fmaxf(m_run[r], row_max * unit);  // -inf stays -inf (unit > 0)
            // A row that has seen nothing yet (window) keeps m = -inf: exponents against 0 then
            // give p = 0 and alpha = 0 rather than NaN.
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;
            alpha[r] = exp2_approx(m_run[r] - m_use);
            m_run[r] = m_new;
            float sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                s[4 * j + 2 * r] = exp2_approx(fmaf(s[4 * j + 2 * r], unit, -m_use));
                s[4 * j + 2 * r + 1] = exp2_approx(fmaf(s[4 * j + 2 * r + 1], unit, -m_use));
                sum[j & 1] += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
            }
            l_run[r] = l_run[r] * alpha[r] + (sum[0] + sum[1]);
        }
    };
    // Probabilities as the value MMAs' A operand (16 positions a slice: the accumulator's column
    // groups 2k and 2k + 1), and the accumulator rescaled.
    auto pack = [&](const float (&s)[64], u32 (&p)[kStep / 16][4]) {
#pragma unroll
        for (int k = 0; k < kStep / 16; ++k) {
#pragma unroll
            for (int q = 0; q < 4; ++q) p[k][q] = pack2<Q_BF16>(s[8 * k + 2 * q], s[8 * k + 2 * q + 1]);
        }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    };

    // The consumer is done with a stage's K or V tile: one arrival per warp (its wgmmas are waited for).
    auto release = [&](u32 barrier) { mbarrier_arrive_if(barrier, lane == 0); };
    if constexpr (OVERLAP) {
        float s[64], alpha[2];
        u32 p[kStep / 16][4];
#pragma unroll
        for (int k = 0; k < 64; ++k) s[k] = 0.0f;  // defined values for the first wgmma's operand list
        if (steps > 0) {
            if constexpr (PINGPONG) bar_arrive_if<256>(kTurn, c == 1);
            wait_keys(0);
            take_turn();
            issue_scores(s, 0);
            pass_turn(false);
            wgmma_wait<0>();
            fence_registers(s);
            release(k_empty(0));
            softmax(s, 0, alpha);
            pack(s, p);
        }
        // Every step but the last: the next step's scores are issued first (no branch around
        // a wgmma: ptxas serializes them when it cannot pair issues with waits).
        for (int i = 0; i + 1 < steps; ++i) {
            wait_keys(i + 1);
            wait_values(i);
            take_turn();
            issue_scores(s, i + 1);
            issue_values(p, i);
            pass_turn(false);
            wgmma_wait<1>();  // the scores (the older group)
            fence_registers(s);
            release(k_empty((i + 1) % STAGES));
            softmax(s, i + 1, alpha);
            // Without this ptxas put the wait above the softmax (SASS of 702165d), which then
            // ran after the value MMAs instead of under them. The sums need every exponential.
            schedule_before_next_wait(fminf(l_run[0], l_run[1]));
            wgmma_wait<0>();
            fence_registers(o);
            release(v_empty(i % STAGES));
            rescale(alpha);
            pack(s, p);
        }
        if (steps > 0) {
            wait_values(steps - 1);
            take_turn();
            issue_values(p, steps - 1);
            pass_turn(true);
            wgmma_wait<0>();
            fence_registers(o);
            // The last V stage is not released: a CTA has one tile, and nothing loads after it
            // (a CTA walking several tiles would need it: a persistent grid measured slower,
            // perf/decisions/paged_attention.md).
        }
    } else {
        for (int i = 0; i < steps; ++i) {
            float s[64], alpha[2];
            u32 p[kStep / 16][4];
#pragma unroll
            for (int k = 0; k < 64; ++k) s[k] = 0.0f;
            wait_keys(i);
            issue_scores(s, i);
            wgmma_wait<0>();
            fence_registers(s);
            release(k_empty(i % STAGES));
            softmax(s, i, alpha);
            pack(s, p);
            rescale(alpha);
            wait_values(i);
            issue_values(p, i);
            wgmma_wait<0>();
            fence_registers(o);
            release(v_empty(i % STAGES));
        }
    }

    // Row sums over the quad; sinks join the denominator; normalize and store this thread's pairs.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
        float factor = 1.0f;
        if (sinks != nullptr) {
            const float sink = sinks[head] * kLog2e, m_all = fmaxf(m_run[r], sink);
            factor = exp2_approx(m_run[r] - m_all);  // 0 when no position was seen
            l_run[r] = l_run[r] * factor + exp2_approx(sink - m_all);
        }
        const float inverse = l_run[r] > 0.0f ? factor / l_run[r] : 0.0f;
        const int row = first_row + row0 + 8 * r;
        if (row >= q_len) continue;
        unsigned char* row_out =
            out + ((i64)(q_start + row) * o_stride_t + (i64)head * o_stride_h + 2 * quad) * 2;
#pragma unroll
        for (int j = 0; j < 16; ++j)
            *reinterpret_cast<u32*>(row_out + 16 * j) =
                pack2<Q_BF16>(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse);
    }
}
