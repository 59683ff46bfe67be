// kernelmux cuda backend: the kernels' compile-time diagnostics, all in one place. Each is a macro
// defined (to 1) for a diagnostic build only; a production build defines none. The host builds
// with them through one mechanism, _compile.diagnostics(*macros) (a scoped setting: every kernel
// loaded within the block is compiled with them, cached apart from the plain builds), which the
// perf/diag scripts use; _compile.DIAGNOSTICS lists the names it accepts.
//
//   KERNELMUX_DIAG_TRACE          paged_decode_fp8.cu: per-CTA %globaltimer marks and SM ids in the
//                                 device array kernelmux_trace (below). perf/diag/cuda_decode_trace.py.
//   KERNELMUX_DIAG_SKIP_SCORES    mla_decode_sm90.cu: leave out the score MMAs (results wrong; times
//                                 only). perf/diag/cuda_mla_ablation.py.
//   KERNELMUX_DIAG_SKIP_VALUES    mla_decode_sm90.cu: leave out the value MMAs. cuda_mla_ablation.py.
//   KERNELMUX_DIAG_SKIP_LOADS     mla_decode_sm90.cu: no cache loads after the first two tiles.
//                                 cuda_mla_ablation.py.
//   KERNELMUX_DIAG_SKIP_CONVERT   mla_decode_sm90.cu: fp8 tiles stored as fetched, unconverted.
//                                 cuda_mla_ablation.py.
//   KERNELMUX_DIAG_WATCHDOG       sm90_common.cuh: an mbarrier wait stuck for 2 s prints its barrier
//                                 and traps instead of hanging (prefill; tests and debugging).
//
// The names keep the KERNELMUX_DIAG_ prefix: tests/engine/test_settings.py tells these macros from
// the KERNELMUX_* environment variables by it.

#pragma once

#include "common.cuh"

// KERNELMUX_DIAG_TRACE: per CTA, the %globaltimer at a kernel's TRACE_MARK(slot, after) marks
// and the SM it ran on, in kernelmux_trace (read by the host through the driver). A mark
// waits for `after` (a value the mark must follow, e.g. a load's result: the comparison with an
// arbitrary constant makes the timer read depend on it), so it times arrivals. Thread 0 keeps its
// marks in shared memory and writes them out as the CTA ends, so a traced CTA adds no global
// stores while it runs. While the other CTAs still stream, a timer read itself seems to wait:
// two marks with nothing but an add between them read up to microseconds apart at the end of a
// CTA's stream, so marks there bound durations from above.
#ifdef KERNELMUX_DIAG_TRACE
constexpr int kTraceCtas = 1 << 16;
extern "C" __device__ unsigned long long kernelmux_trace[kTraceCtas][8];
__device__ __forceinline__ void trace_mark(unsigned long long* marks, int slot, u32 after) {
    if (threadIdx.x == 0 && after != 0x7fc00001u) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        marks[slot] = now;
        if (slot == 0) {
            u32 sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            marks[7] = sm;
        }
    }
}
__device__ __forceinline__ void trace_write(const unsigned long long* marks) {
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0 && cta < kTraceCtas)
        for (int slot = 0; slot < 8; ++slot) kernelmux_trace[cta][slot] = marks[slot];
}
#define TRACE_MARKS __shared__ unsigned long long trace_marks[8]
#define TRACE_MARK(slot, after) trace_mark(trace_marks, slot, (u32)(after))
#define TRACE_WRITE() trace_write(trace_marks)
#else
#define TRACE_MARKS
#define TRACE_MARK(slot, after)
#define TRACE_WRITE()
#endif
