// What the host glue of a HIP kernel (csrc/torch/gpu/*_gpu.cpp) needs from where it runs: the GPU
// build (CUDA or ROCm torch tensors, a device guard, torch's current stream, the CUDA dispatch key
// of torch.ops.qwen4exp), or the SIMT emulator's (CPU tensors, no device, the CPU dispatch key of
// the emulator's own op library qwen4exp_simt<wave size>). The glue files are the same for both, so
// the emulator tests the GPU build's checks, params and launchers, not a copy of them.
#pragma once

#if defined(QWEN4EXP_SIMT_WAVE_SIZE)

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../../common/platform.h"

#define QWEN4EXP_GLUE_LIBRARY_CAT(a, b) a##b
#define QWEN4EXP_GLUE_LIBRARY_NAME(wave) QWEN4EXP_GLUE_LIBRARY_CAT(qwen4exp_simt, wave)
// qwen4exp_simt32 or qwen4exp_simt64.
#define QWEN4EXP_GLUE_LIBRARY QWEN4EXP_GLUE_LIBRARY_NAME(QWEN4EXP_SIMT_WAVE_SIZE)
#define QWEN4EXP_GLUE_DISPATCH_KEY CPU

namespace qwen4exp {
namespace glue {

// Where the tensors of one call must be.
inline bool on_kernel_device(const at::Tensor& t) { return t.device().is_cpu(); }
struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};
inline hipStream_t current_stream() { return nullptr; }
// Whether the stream is being captured into a graph (host copies are impossible then).
inline bool capturing() { return false; }

}  // namespace glue
}  // namespace qwen4exp

#else

#define QWEN4EXP_GPU_HOST_GLUE 1

// c10's stream and guard headers need only the runtime (ATen/cuda/CUDAContext.h would pull in
// cuBLAS/cuSPARSE headers that a minimal toolkit lacks).
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../../common/platform.h"

// ROCm torch hipifies this glue and keeps the CUDA dispatch key.
#define QWEN4EXP_GLUE_LIBRARY qwen4exp
#define QWEN4EXP_GLUE_DISPATCH_KEY CUDA

namespace qwen4exp {
namespace glue {

inline bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
using DeviceGuard = c10::cuda::CUDAGuard;
inline hipStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

}  // namespace glue
}  // namespace qwen4exp

#endif

// TORCH_LIBRARY_IMPL pastes its namespace argument: this indirection expands the macros first.
#define QWEN4EXP_GLUE_IMPL_EXPANDED(library, key, m) TORCH_LIBRARY_IMPL(library, key, m)
#define QWEN4EXP_GLUE_IMPL(m) \
  QWEN4EXP_GLUE_IMPL_EXPANDED(QWEN4EXP_GLUE_LIBRARY, QWEN4EXP_GLUE_DISPATCH_KEY, m)
