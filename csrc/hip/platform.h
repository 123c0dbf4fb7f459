// One kernel source for AMD and NVIDIA.
//
// The kernels in csrc/hip/ are written in HIP. hipcc compiles them as they are; nvcc compiles the
// same files through this header, which maps the few HIP runtime names we use onto CUDA. Keep the
// list short: every name added here is one more thing that has to mean the same on both vendors.
//
// This header is torch-free on purpose: CI compiles every csrc/hip kernel with a bare hipcc (no
// torch headers) to prove the AMD build, and the CPU kernels include the host/device helpers too.
#pragma once

#include <cstdint>

// The GPU runtime is included only where it is needed: in device compiles, and in the host glue
// (csrc/gpu/*.cpp), which defines QWEN4EXP_GPU_HOST_GLUE. The CPU kernels share the helpers below
// and must build without any GPU toolkit.
#if defined(__HIPCC__) || (defined(QWEN4EXP_GPU_HOST_GLUE) && defined(__HIP_PLATFORM_AMD__))
#include <hip/hip_runtime.h>
#define QWEN4EXP_HIP 1
#elif defined(__CUDACC__) || defined(QWEN4EXP_GPU_HOST_GLUE)
#include <cuda_runtime.h>
#define QWEN4EXP_CUDA 1
using hipStream_t = cudaStream_t;
using hipError_t = cudaError_t;
#define hipSuccess cudaSuccess
#define hipGetLastError cudaGetLastError
#define hipGetErrorString cudaGetErrorString
#endif

// QWEN4EXP_HD marks helpers shared by the device kernels and the CPU kernels (a plain C++ build
// sees neither __HIPCC__ nor __CUDACC__ and gets ordinary inline functions).
#if defined(__HIPCC__) || defined(__CUDACC__)
#define QWEN4EXP_HD __host__ __device__ __forceinline__
#define QWEN4EXP_DEVICE __device__ __forceinline__
#else
#define QWEN4EXP_HD inline
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
// MI325X, MI355X) runs 64-wide wavefronts, RDNA and NVIDIA 32-wide. The compiler tells us per
// target, so one source serves all; host passes get 0 so that host code cannot depend on it.
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define QWEN4EXP_WAVE_SIZE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__CUDA_ARCH__)
#define QWEN4EXP_WAVE_SIZE 32
#else
#define QWEN4EXP_WAVE_SIZE 0
#endif

namespace qwen4exp {

// High 64 bits of the 128-bit product a·b.
QWEN4EXP_HD uint64_t mul_hi_u64(uint64_t a, uint64_t b) {
#if defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

}  // namespace qwen4exp
