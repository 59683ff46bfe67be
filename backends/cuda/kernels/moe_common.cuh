// kernelmux cuda backend: device helpers both fused_moe kernel files share (fused_moe_sm90.cu, the Hopper
// GEMMs; fused_moe_decode.cu, the decode GEMVs): a pair's local expert, and the spec's gate-up epilogue
// arithmetic (gate and up rounded to the hidden dtype, the activation and product in fp32).
// _toolchain.py hands every kernels/*.cuh to NVRTC, so a kernel includes it by name.

#pragma once

#include "common.cuh"

namespace {

// The local expert of pair p (-1: routed to another rank).
__device__ __forceinline__ int local_expert(const int* ids, const int* expert_map, int pair, int topk,
                                            i64 ids_stride_t, i64 ids_stride_k, i64 map_stride) {
    const int id = ids[(i64)(pair / topk) * ids_stride_t + (i64)(pair % topk) * ids_stride_k];
    return expert_map != nullptr ? expert_map[(i64)id * map_stride] : id;
}

// x and y rounded to the 16-bit dtype and back.
template <bool BF16>
__device__ __forceinline__ void round2(float& x, float& y) { unpack2<BF16>(pack2<BF16>(x, y), x, y); }

// act(gate) * up as the spec's dataflow: gate and up already rounded to the hidden dtype, the
// activation and product in fp32 (rounded by the caller's store).
template <bool GELU>
__device__ __forceinline__ float gated(float gate, float up) {
    if constexpr (GELU) {
        return 0.5f * gate * (1.0f + erff(gate * 0.7071067811865476f)) * up;
    } else {
        return gate / (1.0f + __expf(-gate)) * up;
    }
}

}  // namespace
