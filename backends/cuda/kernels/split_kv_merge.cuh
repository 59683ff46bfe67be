// kernelmux cuda backend: the one split-KV merge, shared by the fp8 paged decode kernel (DIM 128)
// and the Hopper MLA decode kernel (DIM 512); host side: backends/cuda/_merge.py.
//
// Both decode kernels, when split, leave per split s, token t and head h: part_acc[s, t, h, DIM]
// (the unnormalized value sum, scaled as the output) and part_ml[0, s, t, h] (the running max of
// the base-2 scores; -inf for a split that saw no position) and part_ml[1, s, t, h] (the sum of
// exp2(score - max)). One CTA per (token, head): the splits' maxima and sums are read at once (a
// thread each), their weights go through shared memory, and GROUPS groups of 128 threads (DIM / 128
// value dims each) sum 1 / GROUPS of the splits apiece, so a merge of 64 splits waits on a few waves
// of loads instead of one per split (the callers' choice of GROUPS: perf/decisions/*.md).
// launch_next_early: let the next kernel launch (and warm its start) while the merge runs
// (_paged_decode.py's _launches says where).

#pragma once

#include "common.cuh"

constexpr int kMergeMaxSplits = 64;  // _merge.py's MAX_SPLITS
constexpr int kMergeGroup = 128;     // threads summing one share of the splits

struct MergeSplitsParams {
    unsigned char* out;      // [T, H, DIM] bf16 / fp16, strides o_stride_t, o_stride_h (elements)
    float* lse;              // [T, H] natural-log sum of exp over every position (and the sink), or null
    const float* part_acc;   // [S, T, H, DIM]
    const float* part_ml;    // [2, S, T, H]
    const float* sinks;      // [H] per-head sink logits (natural log), or null
    int num_tokens, num_heads, num_splits, launch_next_early;
    i64 o_stride_t, o_stride_h;
};

template <int DIM, int GROUPS, bool Q_BF16>
__global__ void __launch_bounds__(GROUPS * kMergeGroup) merge_splits(
    unsigned char* __restrict__ out, float* __restrict__ lse, const float* __restrict__ part_acc,
    const float* __restrict__ part_ml, const float* __restrict__ sinks, int num_tokens, int num_heads,
    int num_splits, int launch_next_early, i64 o_stride_t, i64 o_stride_h) {
    constexpr int kVec = DIM / kMergeGroup;  // value dims a thread sums
    static_assert(kVec * kMergeGroup == DIM && (kVec == 1 || kVec == 4), "DIM: 128 or 512");
    static_assert(GROUPS == 1 || GROUPS == 2, "GROUPS: 1 or 2");
    __shared__ float weight[kMergeMaxSplits];
    __shared__ float warp_max[2], warp_total[2];
    __shared__ float second_half[GROUPS == 2 ? DIM : 1];
    const int token = blockIdx.x, head = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    wait_for_previous_grid();  // launched overlapping the decode kernel: its partials first
    if (launch_next_early) allow_next_grid();
    const i64 first = (i64)token * num_heads + head, stride = (i64)num_tokens * num_heads;

    // Threads 0 .. 63 (warps 0 and 1): split tid's running max and sum.
    float m = neg_inf(), l = 0.0f;
    if (tid < num_splits) {
        m = part_ml[first + tid * stride];
        l = part_ml[(i64)num_splits * stride + first + tid * stride];
    }
    float x = m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    if (lane == 0 && warp < 2) warp_max[warp] = x;
    __syncthreads();
    const float m_max = fmaxf(warp_max[0], warp_max[1]);
    const float m_use = m_max == neg_inf() ? 0.0f : m_max;
    const float w = tid < num_splits ? exp2_approx(m - m_use) : 0.0f;  // 0 for empty splits
    if (tid < kMergeMaxSplits) weight[tid] = w;
    x = l * w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0 && warp < 2) warp_total[warp] = x;
    __syncthreads();

    const int d = (tid % kMergeGroup) * kVec, group = tid / kMergeGroup;
    float value[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) value[i] = 0.0f;
#pragma unroll 8
    for (int s = group; s < num_splits; s += GROUPS) {
        const float* partial = part_acc + (first + s * stride) * DIM + d;
        if constexpr (kVec == 4) {
            const float4 v = *reinterpret_cast<const float4*>(partial);
            value[0] += v.x * weight[s];
            value[1] += v.y * weight[s];
            value[2] += v.z * weight[s];
            value[3] += v.w * weight[s];
        } else {
            value[0] += *partial * weight[s];
        }
    }
    if constexpr (GROUPS == 2) {
        if (group == 1) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) second_half[d + i] = value[i];
        }
        __syncthreads();
        if (group == 1) return;
#pragma unroll
        for (int i = 0; i < kVec; ++i) value[i] += second_half[d + i];
    }
    float denominator = warp_total[0] + warp_total[1];
    if (sinks != nullptr) denominator += exp2_approx(sinks[head] * kLog2e - m_use);
    if (lse != nullptr && tid == 0) lse[first] = (m_max + log2_approx(denominator)) * kLn2;
    if (denominator == 0.0f) denominator = 1.0f;  // nothing visible: zeros
    unsigned char* row = out + ((i64)token * o_stride_t + (i64)head * o_stride_h + d) * 2;
    if constexpr (kVec == 4) {
        uint2 packed;
        packed.x = pack2<Q_BF16>(value[0] / denominator, value[1] / denominator);
        packed.y = pack2<Q_BF16>(value[2] / denominator, value[3] / denominator);
        *reinterpret_cast<uint2*>(row) = packed;
    } else {
        const u32 packed = pack2<Q_BF16>(value[0] / denominator, 0.0f);
        *reinterpret_cast<u16*>(row) = (u16)(packed & 0xffffu);
    }
}
