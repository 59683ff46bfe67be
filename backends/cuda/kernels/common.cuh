// kernelmux cuda backend: device helpers every kernel of the backend shares, whatever its target
// arch (paged_decode_fp8.cu runs from sm_89; sm90_common.cuh adds the Hopper-only ones): the
// integer types, -inf, log2(e) and ln(2), the base-2 exponential and logarithm, fp32 pairs
// packed into 16-bit pairs and back, e4m3 pairs into f16 pairs, and a streaming 16-byte load.
// _toolchain.py hands every kernels/*.cuh to NVRTC, so a kernel includes it by name.

#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes read once (weight rows, activations being quantized): not kept in L1, 256-byte L2 fills.
__device__ __forceinline__ uint4 stream_load(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Two floats as a 16-bit pair (bf16 or f16), lo in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 d;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    }
    return d;
}

// A 16-bit pair (bf16 or f16, lo in the low half) as two floats: pack2's inverse, exact.
template <bool BF16>
__device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi) {
    if constexpr (BF16) {
        lo = __uint_as_float(v << 16);
        hi = __uint_as_float(v & 0xffff0000u);
    } else {
        asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
            : "=f"(lo), "=f"(hi) : "r"(v));
    }
}

// Two e4m3 values (the low 16 bits of v, the first low) as an f16 pair, exact (sm_89 on).
__device__ __forceinline__ u32 cvt_e4m3x2_f16x2(u32 v) {
    u32 h;
    asm("{\n\t.reg .b16 l;\n\tcvt.u16.u32 l, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(h) : "r"(v));
    return h;
}

// Programmatic dependent launch (sm_90 and newer; a no-op before, and for a grid launched without
// it): wait until the grid before this one on the stream has finished and its writes are visible.
// A kernel launched with _driver.Kernel's overlap_previous calls this before its first global access.
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the grid after this one on the stream launch (it still waits for this one to finish before
// it reads anything): its CTAs can then take SMs this grid leaves idle.
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace

// The kernels' named ABI (backends/cuda/_params.py): each kernel's parameters are the fields of
// one params struct, in order; the host appends static_asserts built on these traits, so a kernel,
// its struct and the struct's ctypes mirror that disagree fail the compilation, naming the struct.
namespace kernelmux_abi {
template <class T> struct Kind { static constexpr char value = '?'; };
template <class T> struct Kind<T*> { static constexpr char value = 'p'; };
template <> struct Kind<int> { static constexpr char value = 'i'; };
template <> struct Kind<long long> { static constexpr char value = 'q'; };
template <> struct Kind<float> { static constexpr char value = 'f'; };
template <class A, class B> struct Same { static constexpr bool value = false; };
template <class A> struct Same<A, A> { static constexpr bool value = true; };
}  // namespace kernelmux_abi
