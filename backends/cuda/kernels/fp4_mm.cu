// kernelmux cuda backend: fp4_mm W4A16 at decode sizes (M <= 32; written for any arch from sm_89, registered where
// measured, on Hopper): out[m, n] = sum_k a[m, k] * W[n, k], W the packed e2m1 weights decoded in registers
// (fp4_mma.cuh) and multiplied on the tensor cores, each weight byte read once for all M rows.
//
// A CTA takes 16 rows of W (a tile of N) and its WARPS warps split K: warp w takes steps w, w + WARPS, ... of
// 128, kFp4MmUnroll steps' loads in flight (more warps where N has few tiles: fp4_mm.py's warps_for). A step
// decodes rows g and g + 8 of the tile once and multiplies them by each group of 8 activation rows (the MMA's B
// columns; lane (g, t) gives row 8 j + g of group j); rows past M repeat the last one and their sums are dropped.
// The warps' sums meet in shared memory, and each output is rounded once (NVFP4: divided by the global scale
// first). Compiled at runtime by NVRTC; see fp4_mm.py.

#include "fp4_mma.cuh"

namespace {

constexpr int kFp4MmUnroll = 2;  // steps a warp loads at a time (perf/decisions/fp4_mm.md)
constexpr int kFp4MmMaxGroups = 4;  // 8 rows of a each: M <= 32 (fp4_mm.py's MAX_ROWS)

// OUT: 0 bf16, 1 fp16, 2 fp32.
template <int OUT>
__device__ __forceinline__ void store_out(unsigned char* p, float v) {
    if constexpr (OUT == 2) {
        *reinterpret_cast<float*>(p) = v;
    } else {
        *reinterpret_cast<u16*>(p) = (u16)pack2<OUT == 0>(v, 0.0f);
    }
}

}  // namespace

// The kernel's parameter list is this struct's fields, in order (named ABI: _params.py).
struct Fp4MmParams {
    const unsigned char* a;        // [M, K] 16-bit
    const unsigned char* b;        // [N, K / 2] packed e2m1
    const unsigned char* b_scale;  // [N, K / block]: e8m0 (MXFP4) or e4m3 (NVFP4) codes
    const float* b_global;         // one element (NVFP4; null for MXFP4)
    unsigned char* out;            // [M, N]
    int m, n, k;
    i64 a_stride, b_stride, scale_stride_n, scale_stride_k, out_stride;
};

template <int WARPS, bool BF16, bool NVFP4, int OUT>
__global__ void __launch_bounds__(WARPS * 32) fp4_mm_gemv(
    const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
    const unsigned char* __restrict__ b_scale, const float* __restrict__ b_global, unsigned char* __restrict__ out,
    int m, int n, int k, i64 a_stride, i64 b_stride, i64 scale_stride_n, i64 scale_stride_k, i64 out_stride) {
    __shared__ float partial[WARPS][16][kFp4MmMaxGroups * 8];
    constexpr int kStepScales = kFp4StepK / (NVFP4 ? 16 : 32);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16, groups = (m + 7) / 8;
    // The lane's first codes, scales and activations of step 0. Rows past N read row N - 1 (their sums are never
    // stored), so no load is guarded by N.
    const i64 r_g = min(row0 + g, n - 1), r_g8 = min(row0 + g + 8, n - 1);
    const unsigned char* row_g = b + r_g * b_stride + 16 * t;
    const unsigned char* row_g8 = b + r_g8 * b_stride + 16 * t;
    const unsigned char* scales_g = b_scale + r_g * scale_stride_n + kStepScales / 4 * t * scale_stride_k;
    const unsigned char* scales_g8 = b_scale + r_g8 * scale_stride_n + kStepScales / 4 * t * scale_stride_k;
    const unsigned char* x_rows[kFp4MmMaxGroups];  // lane g's activation row of each group (past M: the last)
#pragma unroll
    for (int j = 0; j < kFp4MmMaxGroups; ++j) x_rows[j] = a + (i64)min(8 * j + g, m - 1) * a_stride * 2 + 64 * t;
    const int steps = (k + kFp4StepK - 1) / kFp4StepK, whole = k / kFp4StepK;
    const i64 step_scales = kStepScales * scale_stride_k;
    float d[kFp4MmMaxGroups][4] = {};
    int first = warp;
    for (; first + (kFp4MmUnroll - 1) * WARPS < whole; first += WARPS * kFp4MmUnroll) {
        fp4_gemv_batch<WARPS, kFp4MmUnroll, BF16, NVFP4, false>(first, steps, k, t, row_g, row_g8, scales_g, scales_g8,
                                                                step_scales, scale_stride_k, x_rows, groups, d);
    }
    if (first < steps) {  // at most kFp4MmUnroll steps remain
        fp4_gemv_batch<WARPS, kFp4MmUnroll, BF16, NVFP4, true>(first, steps, k, t, row_g, row_g8, scales_g, scales_g8,
                                                               step_scales, scale_stride_k, x_rows, groups, d);
    }
    // Lane (g, t) holds rows (g, g + 8) x activation rows (8 j + 2 t, 8 j + 2 t + 1) of each group j.
#pragma unroll
    for (int j = 0; j < kFp4MmMaxGroups; ++j) {
        partial[warp][g][8 * j + 2 * t] = d[j][0];
        partial[warp][g][8 * j + 2 * t + 1] = d[j][1];
        partial[warp][g + 8][8 * j + 2 * t] = d[j][2];
        partial[warp][g + 8][8 * j + 2 * t + 1] = d[j][3];
    }
    __syncthreads();
    const float unbias = NVFP4 ? kNvfp4Unbias<BF16> : 1.0f;
    const float global = NVFP4 ? *b_global : 1.0f;
    for (int i = threadIdx.x; i < 16 * kFp4MmMaxGroups * 8; i += WARPS * 32) {
        const int row = i / (kFp4MmMaxGroups * 8), col = i - row * (kFp4MmMaxGroups * 8);
        if (col >= m || row0 + row >= n) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += partial[w][row][col];
        if constexpr (NVFP4) sum = sum * unbias / global;
        store_out<OUT>(out + ((i64)col * out_stride + row0 + row) * (OUT == 2 ? 4 : 2), sum);
    }
}
