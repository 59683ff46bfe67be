// kernelmux cuda backend: device helpers shared by the Hopper (sm_90a) kernels, mla_decode_sm90.cu,
// paged_prefill_sm90.cu, fused_moe_sm90.cu and scaled_mm_sm90.cu: cp.async copies into shared memory, the proxy
// fence, named barriers, register hand-offs between warpgroups, mbarriers, TMA tile loads, wgmma descriptors,
// groups and accumulator rows, the m64n128k16 (16-bit) and m64n128k32 (e4m3) wgmmas, scale loads pinned in place,
// and a scheduling hint for ptxas (common.cuh has the arch-neutral ones).
// _toolchain.py hands every kernels/*.cuh to NVRTC, so a kernel includes it by name.

#pragma once

#include "common.cuh"

// A TMA tensor map (CUtensorMap): 128 opaque bytes the host encodes (_driver.tensor_map), passed as a
// __grid_constant__ kernel parameter so the TMA unit reads it from parameter space.
struct alignas(64) TensorMap {
    u64 words[16];
};
namespace kernelmux_abi {
template <> struct Kind<TensorMap> { static constexpr char value = 'm'; };
}  // namespace kernelmux_abi

namespace {

__device__ __forceinline__ u32 shared_address(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// 16 bytes global -> shared, of which the first `bytes` are read and the rest zero-filled.
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Shared-memory writes of the generic proxy (cp.async, st.shared) made visible to the async proxy
// wgmma reads through; a barrier after it makes every thread's visible to the other warpgroups.
__device__ __forceinline__ void fence_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barriers: one side arrives without waiting, the other waits; THREADS counts both sides.
template <int THREADS>
__device__ __forceinline__ void bar_sync(int id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
// An arrival when `arrive` is nonzero (predicated: no branch among a warpgroup's wgmmas).
template <int THREADS>
__device__ __forceinline__ void bar_arrive_if(int id, int arrive) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\t@p bar.arrive %0, %1;\n\t}"
                 ::"r"(id), "n"(THREADS), "r"(arrive) : "memory");
}

// Warp specialization: a warpgroup gives registers back to the pool (the producer) or takes them from it
// (the consumers); every warp of the warpgroup executes it.
template <int REGISTERS>
__device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}
// The first of the two accumulator rows of an m64 wgmma tile that thread `tid` of its warpgroup holds (the
// other is 8 rows below); its columns are 8 j + 2 (tid % 4) (+1) of each 8-column group j.
__device__ __forceinline__ int accumulator_row(int tid) { return ((tid & 127) >> 5) * 16 + ((tid & 31) >> 2); }
// mbarriers (64-bit, in shared memory): a phase completes once `count` arrivals have come; a
// waiter names the phase by its parity (0 for the first, then alternating per completion).
__device__ __forceinline__ void mbarrier_init(u32 barrier, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(count) : "memory");
}
// An arrival when `arrive` is nonzero: a predicate, not a branch, so one lane can signal for its
// warp between wgmmas without making ptxas serialize them.
__device__ __forceinline__ void mbarrier_arrive_if(u32 barrier, int arrive) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %1, 0;\n\t@p mbarrier.arrive.shared::cta.b64 _, [%0];\n\t}"
                 ::"r"(barrier), "r"(arrive) : "memory");
}
#ifdef KERNELMUX_DIAG_WATCHDOG
// Diagnostic builds (diagnostics.cuh): a wait still incomplete after 2 s names its barrier and traps (a protocol
// mismatch otherwise hangs the GPU until the process is killed, and says nothing).
__device__ __forceinline__ void mbarrier_wait(u32 barrier, u32 parity) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        u32 done;
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
        if (done) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > 2000000000ull) {
            printf("watchdog: block %d thread %d waits on mbarrier 0x%x parity %u\n", (int)blockIdx.x,
                   (int)threadIdx.x, barrier, parity);
            __trap();
        }
    }
}
#else
__device__ __forceinline__ void mbarrier_wait(u32 barrier, u32 parity) {
    asm volatile("{\n\t.reg .pred done;\n\tKM_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra KM_WAIT;\n\t}" ::"r"(barrier), "r"(parity) : "memory");
}
#endif
// One arrival on `barrier` once every cp.async this thread issued before it has landed (.noinc:
// the arrival is one of the barrier's `count`, not an extra one).
__device__ __forceinline__ void copy_arrive(u32 barrier) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// One arrival that also expects `bytes` more of asynchronous copies (TMA) to complete the phase.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u32 barrier, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}
// TMA: the box of `map` at coordinates (x, y, z) (x innermost) into shared memory at `dst`, completing
// `barrier` by its bytes. Elements past the tensor's bounds arrive as zeros.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap& map, int x, int y, int z, u32 barrier) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(y), "r"(z), "r"(barrier) : "memory");
}

// A wgmma shared-memory matrix descriptor with the 128-byte swizzle. K-major operands: `stride`
// steps 8 rows (1024 bytes), `leading` unused. N-major: `leading` steps 64 columns (one column
// block), `stride` 8 rows of K.
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading, u32 stride) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16) |
           ((u64)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// A scale, loaded where the source puts it: ld.global.nc is otherwise free to sink past the volatile waits and wgmmas
// towards its use, which would put its latency back in the step.
__device__ __forceinline__ float load_scale(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// ptxas schedules a wgmma wait as early as its own operands allow: above independent arithmetic
// the source puts before it (register fences stay in the PTX; ptxas reorders the SASS). A
// warp-uniform branch on `value` ends a block that ptxas does not hoist the next wait out of, so
// the arithmetic `value` depends on runs before the wait, under the MMAs it waits for. The branch
// is never taken for value >= 0 or NaN, and its body would do nothing.
__device__ __forceinline__ void schedule_before_next_wait(float value) {
    if (__any_sync(0xffffffffu, value < 0.0f)) asm volatile("nanosleep.u32 0;" ::: "memory");
}

// Ties accumulators to the wait before them: without it the compiler may read a register between
// the wgmma that writes it (asynchronously) and the wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace

// Eight accumulator registers d[i .. i + 7] as read-write asm operands.
#define KM_ACC8(d, i)                                                                                   \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),       \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// 64 accumulator registers as read-write asm operands, and their PTX operand list.
#define KM_ACC64(d)                                                                                     \
    KM_ACC8(d, 0), KM_ACC8(d, 8), KM_ACC8(d, 16), KM_ACC8(d, 24), KM_ACC8(d, 32), KM_ACC8(d, 40),     \
        KM_ACC8(d, 48), KM_ACC8(d, 56)
#define KM_REGS64                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "   \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "    \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "    \
    "%59, %60, %61, %62, %63}"

namespace {

// d (+)= A (64 x 16, K-major, shared) B (16 x 128, K-major, shared); accumulate 0 overwrites d.
template <bool BF16>
__device__ __forceinline__ void mma_ss_m64n128k16(float (&d)[64], u64 a, u64 b, int accumulate) {
#define KM_MMA(T)                                                                                      \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"                                   \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " KM_REGS64                  \
                 ", %64, %65, p, 1, 1, 0, 0;\n\t}"                                                    \
                 : KM_ACC64(d)                                                                         \
                 : "l"(a), "l"(b), "r"(accumulate))
    if constexpr (BF16) {
        KM_MMA("bf16");
    } else {
        KM_MMA("f16");
    }
#undef KM_MMA
}

// d += A (64 x 16, from registers: the accumulator layout's pairs packed) B (16 x 128, N-major).
template <bool BF16>
__device__ __forceinline__ void mma_rs_m64n128k16(float (&d)[64], const u32 (&a)[4], u64 b) {
#define KM_MMA(T)                                                                                      \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %69, 0;\n\t"                                   \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " KM_REGS64                  \
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n\t}"                                        \
                 : KM_ACC64(d)                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
    if constexpr (BF16) {
        KM_MMA("bf16");
    } else {
        KM_MMA("f16");
    }
#undef KM_MMA
}

// d (+)= A (64 x 32 e4m3, K-major, shared) B (32 x 128 e4m3, K-major, shared); accumulate 0 overwrites d.
// 8-bit wgmmas take both operands K-major and have no transpose flags.
__device__ __forceinline__ void mma_e4m3_m64n128k32(float (&d)[64], u64 a, u64 b, int accumulate) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " KM_REGS64 ", %64, %65, p, 1, 1;\n\t}"
                 : KM_ACC64(d)
                 : "l"(a), "l"(b), "r"(accumulate));
}

}  // namespace
