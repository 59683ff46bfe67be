// kernelmux cuda backend: fused_moe's decode GEMVs, for 16-bit experts (written for any arch from sm_80) and for
// fp4 experts (MXFP4, NVFP4: W4A16 on the tensor cores, at the end of the file; NVFP4's e4m3 scales need sm_89).
// The registration takes them where they were measured, on Hopper.
//
// At T = 1 every (token, slot) pair has an expert of its own and the call is a stream of the routed experts'
// weights (Qwen3-30B-A3B: 75 MB, 18 us at the copy rate). The triton backend's grouped kernels take four
// launches there (routing, gate-up, down, the top-k sum) and gate-up runs 96 programs on 132 SMs. Here two
// launches, no routing layout, no per-pair buffer, every SM's warps loading:
//   - moe_decode_gate_up: a warp a task, task = (pair, column j): rows j (gate) and I + j (up) of the pair's
//     expert against its token's input, kGateUpSteps 16-byte loads of each row in flight per lane before
//     their products, then the spec's epilogue into the intermediate [T * k, I]. A pair routed to another
//     rank is skipped (down adds nothing for it).
//   - moe_decode_down: a warp a task, task = (token, column h): row h of each of the token's k experts' w2
//     against that pair's intermediate, the (slot, 16-byte piece) walk flattened so a lane has kDownSteps
//     loads in flight however short I is; each slot's product times its router weight, summed in fp32 and
//     rounded once into the output.
// Warps stride over the tasks, each taking as many as the GPU's resident warps need to cover them in one
// pass, and the grid is as small as gives every warp that many (fused_moe.py's _gemv_grid). Both launch as
// programmatic dependents (PDL): gate-up waits for the kernel before it, then lets down launch, whose CTAs take
// SMs as gate-up's retire. Compiled at runtime by NVRTC; see fused_moe.py.

#include "fp4_mma.cuh"
#include "moe_common.cuh"

namespace {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kChunk = 8;        // 16-bit elements per 16-byte load
constexpr int kGateUpSteps = 4;  // 16-byte loads of each of a task's two rows in flight per lane
constexpr int kBatch = 32 * kChunk * kGateUpSteps;  // a gate-up warp's elements of K per batch of loads
constexpr int kDownSteps = 8;    // 16-byte loads of w2 in flight per lane

// acc + the dot product of 8 16-bit weights and 8 16-bit activations, in fp32.
template <bool BF16>
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    const u32 ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float w0, w1, x0, x1;
        unpack2<BF16>(ws[i], w0, w1);
        unpack2<BF16>(xs[i], x0, x1);
        acc = fmaf(w0, x0, acc);
        acc = fmaf(w1, x1, acc);
    }
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <bool BF16>
__device__ __forceinline__ void store_rounded(unsigned char* p, float v) {
    *reinterpret_cast<u16*>(p) = (u16)pack2<BF16>(v, 0.0f);
}

}  // namespace

// The kernels' parameter lists are these structs' fields, in order (named ABI: _params.py).
struct MoeDecodeGateUpParams {
    const unsigned char* hidden;  // [T, H]
    const unsigned char* w1;      // [E, 2I, H]
    unsigned char* inter;         // [T * k, I]
    const int* topk_ids;
    const int* expert_map;        // null: the ids are local
    const float* topk_weights;    // read only under on_input (top-1)
    int num_pairs, topk, inter_size, hidden_size, on_input;
    i64 hidden_stride, w1_stride_e, w1_stride_n, inter_stride, ids_stride_t, ids_stride_k, map_stride,
        weights_stride_t;
};

struct MoeDecodeDownParams {
    const unsigned char* inter;   // [T * k, I]
    const unsigned char* w2;      // [E, H, I]
    unsigned char* out;           // [T, H]
    const int* topk_ids;
    const int* expert_map;
    const float* topk_weights;
    int num_tokens, topk, hidden_size, inter_size, on_input;
    i64 inter_stride, w2_stride_e, w2_stride_n, out_stride, ids_stride_t, ids_stride_k, map_stride,
        weights_stride_t, weights_stride_k;
};

// inter[pair, j] = act(round(x . gate_j)) * round(x . up_j), rounded; x the pair's token's input, times its
// router weight under on_input (applied to the fp32 sums: the same up to fp32 rounding).
template <bool BF16, bool GELU>
__global__ void __launch_bounds__(kGemvThreads) moe_decode_gate_up(
    const unsigned char* __restrict__ hidden, const unsigned char* __restrict__ w1, unsigned char* __restrict__ inter,
    const int* __restrict__ topk_ids, const int* __restrict__ expert_map, const float* __restrict__ topk_weights,
    int num_pairs, int topk, int inter_size, int hidden_size, int on_input, i64 hidden_stride, i64 w1_stride_e,
    i64 w1_stride_n, i64 inter_stride, i64 ids_stride_t, i64 ids_stride_k, i64 map_stride, i64 weights_stride_t) {
    wait_for_previous_grid();
    allow_next_grid();
    const int lane = threadIdx.x & 31, warps = gridDim.x * kGemvWarps;
    const int tasks = num_pairs * inter_size;
    for (int task = blockIdx.x * kGemvWarps + (threadIdx.x >> 5); task < tasks; task += warps) {
        const int pair = task / inter_size, column = task - pair * inter_size;
        const int expert = local_expert(topk_ids, expert_map, pair, topk, ids_stride_t, ids_stride_k, map_stride);
        if (expert < 0) continue;
        const unsigned char* gate_row = w1 + ((i64)expert * w1_stride_e + (i64)column * w1_stride_n) * 2;
        const unsigned char* up_row = gate_row + (i64)inter_size * w1_stride_n * 2;
        const unsigned char* x = hidden + (i64)(pair / topk) * hidden_stride * 2;
        float gate = 0.0f, up = 0.0f;
        int base = 0;  // warp-uniform: whole batches of kGateUpSteps pieces, their loads unpredicated, then the rest
        for (; base + kBatch <= hidden_size; base += kBatch) {
            uint4 g[kGateUpSteps], u[kGateUpSteps], a[kGateUpSteps];
#pragma unroll
            for (int s = 0; s < kGateUpSteps; ++s) {
                const int k = base + (s * 32 + lane) * kChunk;
                g[s] = stream_load(gate_row + 2 * k);
                u[s] = stream_load(up_row + 2 * k);
                a[s] = *reinterpret_cast<const uint4*>(x + 2 * k);
            }
#pragma unroll
            for (int s = 0; s < kGateUpSteps; ++s) {
                gate = dot8<BF16>(g[s], a[s], gate);
                up = dot8<BF16>(u[s], a[s], up);
            }
        }
        for (int k = base + lane * kChunk; k < hidden_size; k += 32 * kChunk) {  // H is a multiple of 8
            const uint4 a = *reinterpret_cast<const uint4*>(x + 2 * k);
            gate = dot8<BF16>(stream_load(gate_row + 2 * k), a, gate);
            up = dot8<BF16>(stream_load(up_row + 2 * k), a, up);
        }
        gate = warp_sum(gate);
        up = warp_sum(up);
        if (lane == 0) {
            if (on_input) {
                const float weight = topk_weights[(i64)(pair / topk) * weights_stride_t];
                gate *= weight;
                up *= weight;
            }
            round2<BF16>(gate, up);
            store_rounded<BF16>(inter + ((i64)pair * inter_stride + column) * 2, gated<GELU>(gate, up));
        }
    }
}

// out[t, h] = sum over the token's slots s with a local expert e_s of weight_s * (w2[e_s, h] . inter[t k + s]),
// in fp32, rounded once (weight_s = 1 under on_input).
template <bool BF16>
__global__ void __launch_bounds__(kGemvThreads) moe_decode_down(
    const unsigned char* __restrict__ inter, const unsigned char* __restrict__ w2, unsigned char* __restrict__ out,
    const int* __restrict__ topk_ids, const int* __restrict__ expert_map, const float* __restrict__ topk_weights,
    int num_tokens, int topk, int hidden_size, int inter_size, int on_input, i64 inter_stride, i64 w2_stride_e,
    i64 w2_stride_n, i64 out_stride, i64 ids_stride_t, i64 ids_stride_k, i64 map_stride, i64 weights_stride_t,
    i64 weights_stride_k) {
    wait_for_previous_grid();
    const int lane = threadIdx.x & 31, warps = gridDim.x * kGemvWarps;
    const int tasks = num_tokens * hidden_size;
    const int row_pieces = inter_size / kChunk, pieces = topk * row_pieces;
    const int step_slots = 32 / row_pieces, step_pieces = 32 - step_slots * row_pieces;  // 32 pieces, as a move
    for (int task = blockIdx.x * kGemvWarps + (threadIdx.x >> 5); task < tasks; task += warps) {
        const int token = task / hidden_size, column = task - token * hidden_size;
        int expert = -1;  // lane s: slot s (topk <= 32)
        float weight = 0.0f;
        if (lane < topk) {
            expert = local_expert(topk_ids, expert_map, token * topk + lane, topk, ids_stride_t, ids_stride_k,
                                  map_stride);
            weight = on_input ? 1.0f : topk_weights[(i64)token * weights_stride_t + (i64)lane * weights_stride_k];
        }
        const unsigned char* w_rows = w2 + (i64)column * w2_stride_n * 2;
        const unsigned char* a_rows = inter + (i64)token * topk * inter_stride * 2;
        // The lane's place in the (slot, piece) walk, moved 32 pieces a step without a division.
        int slot = lane / row_pieces, piece = lane - slot * row_pieces;
        float acc = 0.0f;
        for (int c0 = 0; c0 < pieces; c0 += 32 * kDownSteps) {  // warp-uniform bound: every lane shuffles
            uint4 w[kDownSteps], a[kDownSteps];
            float r[kDownSteps];
#pragma unroll
            for (int s = 0; s < kDownSteps; ++s) {
                const int source = min(slot, topk - 1);
                const int e = __shfl_sync(0xffffffffu, expert, source);
                r[s] = __shfl_sync(0xffffffffu, weight, source);
                if (slot < topk && e >= 0) {
                    w[s] = stream_load(w_rows + ((i64)e * w2_stride_e + piece * kChunk) * 2);
                    a[s] = *reinterpret_cast<const uint4*>(a_rows + ((i64)slot * inter_stride + piece * kChunk) * 2);
                } else {
                    w[s] = a[s] = make_uint4(0, 0, 0, 0);
                }
                slot += step_slots;
                piece += step_pieces;
                if (piece >= row_pieces) {
                    piece -= row_pieces;
                    ++slot;
                }
            }
#pragma unroll
            for (int s = 0; s < kDownSteps; ++s) acc = fmaf(r[s], dot8<BF16>(w[s], a[s], 0.0f), acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) store_rounded<BF16>(out + ((i64)token * out_stride + column) * 2, acc);
    }
}

// ---- fp4 experts (MXFP4 / NVFP4 weights, W4A16): the same two launches on the tensor cores (fp4_mma.cuh) ----
// A warp's step is 16 weight rows x 128 of K, its loads issued a batch of steps ahead of their decoding (gate-up:
// fp4_gemv_batch's unguarded batches of kFp4GateUpUnroll; down: kFp4Unroll steps of fp4_gemv_step); a CTA's warps
// split one tile's steps and add their sums through shared memory (cta_row_sums), so no partial sum leaves the
// CTA. The activations come from global memory (L1), permuted in registers (x_pairs): staging them in shared
// memory made the replayed call slower (perf/decisions/fused_moe.md).
//   - moe_decode_fp4_gate_up: a CTA a (pair, 8 columns j): rows j..j+7 of gate and I+j..I+j+7 of up, so each
//     lane ends with a column's gate and up and the epilogue needs no exchange.
//   - moe_decode_fp4_down: a CTA a (token, 16 columns of H), its warps over the (slot, step) items of the
//     token's k experts, each item's sum times its slot's router weight.

struct MoeDecodeFp4GateUpParams {
    const unsigned char* hidden;    // [T, H]
    const unsigned char* w1;        // [E, 2I, H / 2] packed e2m1
    const unsigned char* w1_scale;  // [E, 2I, H / block]: e8m0 (MXFP4) or e4m3 (NVFP4) codes
    const float* w1_global;         // [E] (NVFP4; null for MXFP4)
    unsigned char* inter;           // [T * k, I]
    const int* topk_ids;
    const int* expert_map;
    const float* topk_weights;
    int num_pairs, topk, inter_size, hidden_size, on_input;
    i64 hidden_stride, w1_stride_e, w1_stride_n, scale_stride_e, scale_stride_n, scale_stride_k, global_stride,
        inter_stride, ids_stride_t, ids_stride_k, map_stride, weights_stride_t;
};

struct MoeDecodeFp4DownParams {
    const unsigned char* inter;     // [T * k, I]
    const unsigned char* w2;        // [E, H, I / 2]
    const unsigned char* w2_scale;  // [E, H, I / block]
    const float* w2_global;         // [E] (NVFP4)
    unsigned char* out;             // [T, H]
    const int* topk_ids;
    const int* expert_map;
    const float* topk_weights;
    int num_tokens, topk, hidden_size, inter_size, on_input;
    i64 inter_stride, w2_stride_e, w2_stride_n, scale_stride_e, scale_stride_n, scale_stride_k, global_stride,
        out_stride, ids_stride_t, ids_stride_k, map_stride, weights_stride_t, weights_stride_k;
};

namespace {

constexpr int kFp4GateUpWarps = 4;
constexpr int kFp4DownWarps = 8;
constexpr int kFp4Unroll = 3;  // steps a warp has in flight, 2 x 16 bytes of weights each per lane (2: 4% slower)
// Gate-up's steps a batch (fp4_gemv_batch). H200, gpt-oss-120b MXFP4 T 1, gate-up kernel 17.97 us at 2, 20.06 at 3,
// 21.26 at 4.
constexpr int kFp4GateUpUnroll = 2;

// A lane's 32 activations at element k of row x (16-bit), as fp4_gemv_step takes them.
__device__ __forceinline__ void load_x(const unsigned char* x, int k, uint4 (&v)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = *reinterpret_cast<const uint4*>(x + 2 * (k + 8 * i));
}

// The CTA's sums of rows g and g + 8 (each warp's lo and hi: its lanes t = 0 hold them) added through shared
// memory; true in the lanes that then hold them (warp 0, t = 0), in lo and hi.
template <int WARPS>
__device__ __forceinline__ bool cta_row_sums(float (&partial)[WARPS][16], float& lo, float& hi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    if ((lane & 3) == 0) {
        partial[warp][g] = lo;
        partial[warp][g + 8] = hi;
    }
    __syncthreads();
    if (warp != 0 || (lane & 3) != 0) return false;
    lo = hi = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        lo += partial[w][g];
        hi += partial[w][g + 8];
    }
    return true;
}

}  // namespace

// inter[pair, j] for the CTA's 8 columns: the spec's epilogue on the fp32 sums of the dequantized weights
// (NVFP4: the sums divided by the expert's global scale).
template <bool BF16, bool GELU, bool NVFP4>
__global__ void __launch_bounds__(kFp4GateUpWarps * 32) moe_decode_fp4_gate_up(
    const unsigned char* __restrict__ hidden, const unsigned char* __restrict__ w1,
    const unsigned char* __restrict__ w1_scale, const float* __restrict__ w1_global, unsigned char* __restrict__ inter,
    const int* __restrict__ topk_ids, const int* __restrict__ expert_map, const float* __restrict__ topk_weights,
    int num_pairs, int topk, int inter_size, int hidden_size, int on_input, i64 hidden_stride, i64 w1_stride_e,
    i64 w1_stride_n, i64 scale_stride_e, i64 scale_stride_n, i64 scale_stride_k, i64 global_stride,
    i64 inter_stride, i64 ids_stride_t, i64 ids_stride_k, i64 map_stride, i64 weights_stride_t) {
    __shared__ float partial[kFp4GateUpWarps][16];
    wait_for_previous_grid();
    allow_next_grid();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = inter_size / 8, pair = blockIdx.x / tiles, column = (blockIdx.x - pair * tiles) * 8;
    const int expert = local_expert(topk_ids, expert_map, pair, topk, ids_stride_t, ids_stride_k, map_stride);
    if (expert < 0) return;  // a pair routed to another rank: down adds nothing for it
    // The lane's first codes, scales and activations (fp4_gemv_batch's pointers at step 0).
    const unsigned char* gate_row = w1 + (i64)expert * w1_stride_e + (i64)(column + g) * w1_stride_n + 16 * t;
    const unsigned char* up_row = gate_row + (i64)inter_size * w1_stride_n;
    constexpr int kStepScales = kFp4StepK / (NVFP4 ? 16 : 32);
    const unsigned char* gate_scales = w1_scale + (i64)expert * scale_stride_e + (i64)(column + g) * scale_stride_n +
                                       kStepScales / 4 * t * scale_stride_k;
    const unsigned char* up_scales = gate_scales + (i64)inter_size * scale_stride_n;
    const unsigned char* const x[1] = {hidden + (i64)(pair / topk) * hidden_stride * 2 + 64 * t};
    const int steps = (hidden_size + kFp4StepK - 1) / kFp4StepK, whole = hidden_size / kFp4StepK;
    const i64 step_scales = kStepScales * scale_stride_k;
    float d[1][4] = {};
    int first = warp;
    for (; first + (kFp4GateUpUnroll - 1) * kFp4GateUpWarps < whole; first += kFp4GateUpWarps * kFp4GateUpUnroll) {
        fp4_gemv_batch<kFp4GateUpWarps, kFp4GateUpUnroll, BF16, NVFP4, false>(
            first, steps, hidden_size, t, gate_row, up_row, gate_scales, up_scales, step_scales, scale_stride_k, x, 1,
            d);
    }
    if (first < steps) {  // at most kFp4GateUpUnroll steps remain
        fp4_gemv_batch<kFp4GateUpWarps, kFp4GateUpUnroll, BF16, NVFP4, true>(
            first, steps, hidden_size, t, gate_row, up_row, gate_scales, up_scales, step_scales, scale_stride_k, x, 1,
            d);
    }
    float gate = d[0][0], up = d[0][2];
    if (cta_row_sums(partial, gate, up)) {
        if constexpr (NVFP4) {
            const float global = w1_global[(i64)expert * global_stride];
            gate = gate * kNvfp4Unbias<BF16> / global;
            up = up * kNvfp4Unbias<BF16> / global;
        }
        if (on_input) {
            const float weight = topk_weights[(i64)(pair / topk) * weights_stride_t];
            gate *= weight;
            up *= weight;
        }
        round2<BF16>(gate, up);
        store_rounded<BF16>(inter + ((i64)pair * inter_stride + column + g) * 2, gated<GELU>(gate, up));
    }
}

// out[t, h] for the CTA's 16 columns: the sum over the token's slots with a local expert of the slot's router
// weight (1 under on_input) times its row's sum (NVFP4: divided by the expert's global scale), in fp32,
// rounded once.
template <bool BF16, bool NVFP4>
__global__ void __launch_bounds__(kFp4DownWarps * 32) moe_decode_fp4_down(
    const unsigned char* __restrict__ inter, const unsigned char* __restrict__ w2,
    const unsigned char* __restrict__ w2_scale, const float* __restrict__ w2_global, unsigned char* __restrict__ out,
    const int* __restrict__ topk_ids, const int* __restrict__ expert_map, const float* __restrict__ topk_weights,
    int num_tokens, int topk, int hidden_size, int inter_size, int on_input, i64 inter_stride, i64 w2_stride_e,
    i64 w2_stride_n, i64 scale_stride_e, i64 scale_stride_n, i64 scale_stride_k, i64 global_stride,
    i64 out_stride, i64 ids_stride_t, i64 ids_stride_k, i64 map_stride, i64 weights_stride_t,
    i64 weights_stride_k) {
    __shared__ float partial[kFp4DownWarps][16];
    wait_for_previous_grid();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = hidden_size / 16, token = blockIdx.x / tiles, column = (blockIdx.x - token * tiles) * 16;
    int expert = -1;  // lane s: slot s's local expert and the factor its sums take (topk <= 32)
    float factor = 0.0f;
    if (lane < topk) {
        expert = local_expert(topk_ids, expert_map, token * topk + lane, topk, ids_stride_t, ids_stride_k,
                              map_stride);
        factor = on_input ? 1.0f : topk_weights[(i64)token * weights_stride_t + (i64)lane * weights_stride_k];
        if constexpr (NVFP4) {
            if (expert >= 0) factor = factor * kNvfp4Unbias<BF16> / w2_global[(i64)expert * global_stride];
        }
    }
    const int steps = (inter_size + kFp4StepK - 1) / kFp4StepK, items = topk * steps;
    float acc[2] = {0.0f, 0.0f};
    for (int first = warp; first < items; first += kFp4DownWarps * kFp4Unroll) {
        uint4 w_g[kFp4Unroll], w_g8[kFp4Unroll];
        u32 s_g[kFp4Unroll], s_g8[kFp4Unroll];
        int slot[kFp4Unroll], e[kFp4Unroll];
#pragma unroll
        for (int u = 0; u < kFp4Unroll; ++u) {
            const int item = first + u * kFp4DownWarps;  // warp-uniform, as slot and e
            slot[u] = item / steps;
            const int k = (item - slot[u] * steps) * kFp4StepK + 32 * t;
            e[u] = __shfl_sync(0xffffffffu, expert, min(slot[u], topk - 1));
            if (item >= items) e[u] = -1;
            w_g[u] = w_g8[u] = make_uint4(0, 0, 0, 0);
            s_g[u] = s_g8[u] = 0;
            if (e[u] >= 0 && k < inter_size) {
                const i64 row = (i64)e[u] * w2_stride_e + (i64)(column + g) * w2_stride_n;
                const unsigned char* scales =
                    w2_scale + (i64)e[u] * scale_stride_e + (i64)(column + g) * scale_stride_n;
                w_g[u] = stream_load(w2 + row + k / 2);
                w_g8[u] = stream_load(w2 + row + 8 * w2_stride_n + k / 2);
                s_g[u] = load_scales<NVFP4>(scales, k, scale_stride_k);
                s_g8[u] = load_scales<NVFP4>(scales + 8 * scale_stride_n, k, scale_stride_k);
            }
        }
#pragma unroll
        for (int u = 0; u < kFp4Unroll; ++u) {
            const float f = __shfl_sync(0xffffffffu, factor, min(slot[u], topk - 1));
            if (e[u] < 0) continue;  // warp-uniform: past the items, or a slot routed to another rank
            const int k = (first + u * kFp4DownWarps - slot[u] * steps) * kFp4StepK + 32 * t;
            uint4 a[4] = {};
            if (k < inter_size) load_x(inter + ((i64)(token * topk + slot[u]) * inter_stride) * 2, k, a);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            fp4_gemv_step<BF16, NVFP4>(w_g[u], w_g8[u], s_g[u], s_g8[u], a, d);
            acc[0] = fmaf(f, d[0], acc[0]);
            acc[1] = fmaf(f, d[2], acc[1]);
        }
    }
    if (cta_row_sums(partial, acc[0], acc[1])) {
        store_rounded<BF16>(out + ((i64)token * out_stride + column + g) * 2, acc[0]);
        store_rounded<BF16>(out + ((i64)token * out_stride + column + g + 8) * 2, acc[1]);
    }
}
