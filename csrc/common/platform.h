// One kernel source for AMD, NVIDIA and the CPU's SIMT emulator.
//
// The kernels in csrc/hip/ are written in HIP. hipcc compiles them as they are; nvcc compiles the
// same files through this header, which maps the few HIP runtime names we use onto CUDA; and the
// host C++ compiler builds them against csrc/simt/runtime.h (QWEN4EXP_SIMT_WAVE_SIZE = 32 or 64),
// which runs them on the CPU for the tests. Keep the list short: every name added here is one
// more thing that has to mean the same on all three.
//
// This header is torch-free on purpose: CI compiles every csrc/hip kernel with a bare hipcc (no
// torch headers) to prove the AMD build, and the CPU kernels include the host/device helpers too.
#pragma once

#include <cstddef>
#include <cstdint>

// The GPU runtime is included only where it is needed: in device compiles, and in the host glue
// (csrc/torch/gpu/*.cpp), which defines QWEN4EXP_GPU_HOST_GLUE. The CPU kernels share the helpers
// below and must build without any GPU toolkit.
#if defined(QWEN4EXP_SIMT_WAVE_SIZE)
#include "../simt/runtime.h"
#define QWEN4EXP_SIMT 1
#elif defined(__HIPCC__) || (defined(QWEN4EXP_GPU_HOST_GLUE) && defined(__HIP_PLATFORM_AMD__))
#include <hip/hip_runtime.h>
#define QWEN4EXP_HIP 1
#elif defined(__CUDACC__) || defined(QWEN4EXP_GPU_HOST_GLUE)
#include <cuda_runtime.h>
#define QWEN4EXP_CUDA 1
using hipStream_t = cudaStream_t;
using hipError_t = cudaError_t;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipGetLastError cudaGetLastError
#define hipGetErrorString cudaGetErrorString
// Pinned host tables (csrc/torch/gpu/host_table.cpp).
#define hipHostGetDevicePointer cudaHostGetDevicePointer
#define hipHostRegister cudaHostRegister
#define hipHostUnregister cudaHostUnregister
#define hipHostRegisterMapped cudaHostRegisterMapped
#define hipHostRegisterPortable cudaHostRegisterPortable
#endif

// Some GPU runtime is here to launch kernels on (the launchers' declarations need it).
#if defined(QWEN4EXP_HIP) || defined(QWEN4EXP_CUDA) || defined(QWEN4EXP_SIMT)
#define QWEN4EXP_HAS_LAUNCHERS 1
#endif

// A compile that sees kernel code: either pass of hipcc or nvcc, or the emulator's build.
#if defined(__HIPCC__) || defined(__CUDACC__) || defined(QWEN4EXP_SIMT)
#define QWEN4EXP_KERNEL_COMPILE 1
#endif

// Code generated for a device: a GPU's device pass, or the emulator, which runs device code on the
// CPU. The shared helpers take their device branch here, so the emulator runs what a GPU runs.
#if defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__) || defined(QWEN4EXP_SIMT)
#define QWEN4EXP_DEVICE_PASS 1
#endif

// QWEN4EXP_HD marks helpers shared by the device kernels and the CPU kernels (a plain C++ build
// sees neither __HIPCC__ nor __CUDACC__ and gets ordinary inline functions).
#if defined(__HIPCC__) || defined(__CUDACC__)
#define QWEN4EXP_HD __host__ __device__ __forceinline__
#define QWEN4EXP_DEVICE __device__ __forceinline__
#elif defined(QWEN4EXP_SIMT)
#define QWEN4EXP_HD inline
#define QWEN4EXP_DEVICE inline
#else
#define QWEN4EXP_HD inline
#endif

// The entry points of the kernel library for C++ engines (the CPU kernels' run_<op>_cpu): visible
// from its shared library, which hides everything else (CMakeLists.txt), so that the inline
// helpers of its CPU build never merge with the device-pass versions an emulator build next to it
// has of the same functions.
#if defined(__GNUC__) || defined(__clang__)
#define QWEN4EXP_API __attribute__((visibility("default")))
#else
#define QWEN4EXP_API
#endif

// Full unrolling of short fixed-trip loops (keeps small arrays in registers on the GPU).
#if defined(__HIPCC__) || defined(__CUDACC__) || defined(__clang__)
#define QWEN4EXP_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define QWEN4EXP_UNROLL _Pragma("GCC unroll 8")
#else
#define QWEN4EXP_UNROLL
#endif

// Wave (warp) size of the device pass being compiled. Never hard-code 32: CDNA (gfx9: MI300X,
// MI325X, MI355X) runs 64-wide wavefronts, RDNA and NVIDIA 32-wide. It comes from the target,
// not from __AMDGCN_WAVEFRONT_SIZE: ROCm 6.3 deprecated that macro (a warning, an error under
// -Werror) and ROCm 7.2 removed it. RDNA's optional wave64 mode (-mwavefrontsize64) is not
// supported. Host passes get 0 so that host code cannot depend on it.
#if defined(QWEN4EXP_SIMT)
#define QWEN4EXP_WAVE_SIZE QWEN4EXP_SIMT_WAVE_SIZE
#elif defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX9__)
#define QWEN4EXP_WAVE_SIZE 64
#elif defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__)
#define QWEN4EXP_WAVE_SIZE 32
#else
#error "qwen4exp: unknown AMD target, no wave size for it (gfx9 is 64-wide, gfx10-gfx12 32)"
#endif
#elif defined(__CUDA_ARCH__)
#define QWEN4EXP_WAVE_SIZE 32
#else
#define QWEN4EXP_WAVE_SIZE 0
#endif

// QWEN4EXP_AMD_MIN_WAVES(n), on a kernel after its __launch_bounds__: on AMD, at least n waves per
// SIMD (amdgpu_waves_per_eu: the register allocator keeps the kernel within the VGPRs that leave
// room for n waves, 512/n on gfx9, rather than take more and lower the occupancy). Where a kernel
// needs more than that, the compiler spills, which the kernel report's gates catch. A kernel's n is
// its op's AMD floor in tools/kernel_report.py (FLOORS). Nothing on nvcc or in the emulator.
#if defined(QWEN4EXP_HIP) && defined(__HIP__)
#define QWEN4EXP_AMD_MIN_WAVES(n) __attribute__((amdgpu_waves_per_eu(n)))
#else
#define QWEN4EXP_AMD_MIN_WAVES(n)
#endif

// Shared memory, declared the same way for all three (a GPU compile gets plain __shared__; the
// emulator gives every block its own 0xFF-filled copy, so a read before any write shows):
//   QWEN4EXP_SHARED(float[64], scratch);      a static __shared__ object (any type)
//   QWEN4EXP_DYNAMIC_SHARED(Item, items);     Item* items: the launch's dynamic shared memory,
//                                             aligned for Item
namespace qwen4exp {
// Names an array type in a declarator position: shared_type_t<float[64]> x.
template <typename T>
using shared_type_t = T;
}  // namespace qwen4exp
#if defined(QWEN4EXP_SIMT)
#define QWEN4EXP_SHARED(Type, name)                                                       \
  static const char name##_qwen4exp_shared_tag = 0;                                       \
  ::qwen4exp::shared_type_t<Type>& name = *static_cast<::qwen4exp::shared_type_t<Type>*>( \
      ::qwen4exp::simt::static_shared(&name##_qwen4exp_shared_tag,                        \
                                      sizeof(::qwen4exp::shared_type_t<Type>),            \
                                      alignof(::qwen4exp::shared_type_t<Type>)))
#define QWEN4EXP_DYNAMIC_SHARED(Type, name) \
  Type* name = static_cast<Type*>(::qwen4exp::simt::dynamic_shared(alignof(Type)))
#elif defined(QWEN4EXP_KERNEL_COMPILE)
#define QWEN4EXP_SHARED(Type, name) __shared__ ::qwen4exp::shared_type_t<Type> name
#define QWEN4EXP_DYNAMIC_SHARED(Type, name) extern __shared__ Type name[]
#endif

namespace qwen4exp {

// The most blocks a launcher asks for along x and y; kernels loop over the rest. ROCm counts a
// grid in threads, in 32 bits per dimension (2^16 blocks of up to 1024 threads fit), and y is at
// most 65535 on both vendors; 2^16 blocks of 256 threads are far more than any GPU runs at once.
constexpr int64_t kMaxGridX = int64_t{1} << 16;
constexpr int64_t kMaxGridY = 65535;

// High 64 bits of the 128-bit product a·b.
QWEN4EXP_HD uint64_t mul_hi_u64(uint64_t a, uint64_t b) {
#if defined(QWEN4EXP_DEVICE_PASS)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// High 32 bits of the 64-bit product a·b (one instruction on both GPU vendors).
QWEN4EXP_HD uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(QWEN4EXP_DEVICE_PASS) && !defined(QWEN4EXP_SIMT)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((uint64_t{a} * b) >> 32);
#endif
}

#if defined(QWEN4EXP_KERNEL_COMPILE)
// v from the lane whose index is this lane's xor `mask`, within the wave (CUDA names the lanes
// taking part; every lane of the wave does here).
QWEN4EXP_DEVICE float shuffle_xor(float v, int mask) {
#if defined(QWEN4EXP_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask);
#else
  return __shfl_xor(v, mask);
#endif
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), returning this launch's status. The
// error state is cleared first, so that an older, unrelated failure of another runtime call is not
// reported as ours (an error that poisons the context, such as a fault in an earlier kernel,
// persists and is returned, as it should be).
template <typename... Params, typename... Args>
hipError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                         hipStream_t stream, const Args&... args) {
#if defined(QWEN4EXP_SIMT)
  (void)stream;
  return simt::launch(kernel, grid, block, shared_bytes, args...);
#else
  (void)hipGetLastError();
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
  return hipGetLastError();
#endif
}
#endif

}  // namespace qwen4exp
