// HIP kernels for the element-wise hyper-connection ops: hc_gate_mix, hc_silu
// (csrc/common/hc_mix.h) and hc_combine without its norm (csrc/common/hc_norm.h; the combine
// with the norm, which reduces, is hc_norm.hip's). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// One thread per chunk of an output row: 16 bytes (one 128-bit access) where the rows, their
// strides and the widths allow it, else one element. A launch covers whole tokens, at most
// kMaxGridX blocks of them. The arithmetic is vLLM's, in its order, with no a·b+c contracted
// (setup.py's device flags) and sigmoid_f32's correctly rounded exp (float_types.h): the CPU
// kernels' vectorised exp can differ from it in the last fp32 bit.
#include <algorithm>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/hc_mix.h"
#include "../common/hc_norm.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;
// The fewest waves per SIMD on AMD: the op's floor in tools/kernel_report.py (FLOORS).
constexpr int kAmdMinWaves = 8;

// The chunk of the launch this thread takes: (token, chunk in the row), false past the last.
QWEN4EXP_DEVICE bool my_chunk(int64_t tokens, uint32_t chunks_per_row, uint32_t* t, uint32_t* c) {
  const uint32_t index = blockIdx.x * kThreads + threadIdx.x;
  if (index >= static_cast<uint64_t>(tokens) * chunks_per_row) return false;
  *t = index / chunks_per_row;
  *c = index - *t * chunks_per_row;
  return true;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_gate_mix_kernel(HcGateMixParams p, uint32_t chunks_per_row) {
  uint32_t t, c;
  if (!my_chunk(p.num_tokens, chunks_per_row, &t, &c)) return;
  const T* x = static_cast<const T*>(p.x) + t * p.x_row_stride + c * VEC;
  const T* gate = static_cast<const T*>(p.gate) + t * p.gate_row_stride + c * VEC;
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  for (int s = 0; s < p.streams; ++s) {
    const int64_t at = static_cast<int64_t>(s) * p.width;
    float g[VEC], v[VEC];
    load_floats<T, VEC>(gate + at, g);
    load_floats<T, VEC>(x + at, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += sigmoid_f32(g[i]) * v[i];
  }
  const float hc = static_cast<float>(p.streams);
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = acc[i] / hc;
  store_floats<T, VEC>(static_cast<T*>(p.out) + t * p.out_row_stride + c * VEC, acc);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_silu_kernel(HcSiluParams p, uint32_t chunks_per_row) {
  uint32_t t, c;
  if (!my_chunk(p.num_tokens, chunks_per_row, &t, &c)) return;
  float z[VEC];
  load_floats<T, VEC>(static_cast<const T*>(p.x) + t * p.x_row_stride + c * VEC, z);
  const float hc = static_cast<float>(p.hc_count);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    z[i] = z[i] / hc;
    z[i] = z[i] * sigmoid_f32(z[i]);
  }
  store_floats<T, VEC>(static_cast<T*>(p.y) + t * p.y_row_stride + c * VEC, z);
}

// hc_combine: chunks of the [T, HC·H] output; a chunk lies in one stream (VEC divides H).
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_combine_kernel(HcCombineParams p, uint32_t chunks_per_row) {
  uint32_t t, c;
  if (!my_chunk(p.num_tokens, chunks_per_row, &t, &c)) return;
  const uint32_t column = c * VEC;
  const uint32_t s = column / static_cast<uint32_t>(p.width);
  const uint32_t i0 = column - s * static_cast<uint32_t>(p.width);
  // No logits (vLLM's NVIDIA module): the block output as it is (b·1 = b).
  float injection = 1.0f;
  if (p.injection_logits != nullptr) {
    const T* logits = static_cast<const T*>(p.injection_logits) + t * p.logits_row_stride;
    injection = 2.0f * sigmoid_f32(widen(logits[s]) / static_cast<float>(p.streams));
  }
  float r[VEC], b[VEC];
  load_floats<T, VEC>(static_cast<const T*>(p.residual) + t * p.residual_row_stride + column, r);
  load_floats<T, VEC>(static_cast<const T*>(p.block_output) + t * p.block_row_stride + i0, b);
#pragma unroll
  for (int i = 0; i < VEC; ++i) r[i] = r[i] + b[i] * injection;
  store_floats<T, VEC>(static_cast<T*>(p.h) + t * p.h_row_stride + column, r);
}

bool aligned_ptr(const void* ptr) { return aligned16(reinterpret_cast<uint64_t>(ptr)); }

// Launches kernel(part, chunks_per_row) over `tokens` rows of chunks_per_row chunks, whole tokens
// and at most kMaxGridX blocks a launch; shift(part, first, count) sets a part's rows.
template <typename P, typename Kernel, typename Shift>
hipError_t launch_chunks(Kernel kernel, const P& p, int64_t tokens, int64_t chunks_per_row,
                         hipStream_t stream, const Shift& shift) {
  const int64_t per_launch = std::max<int64_t>(1, kMaxGridX * kThreads / chunks_per_row);
  for (int64_t t0 = 0; t0 < tokens; t0 += per_launch) {
    P part = p;
    const int64_t count = std::min(per_launch, tokens - t0);
    shift(part, t0, count);
    const unsigned blocks =
        static_cast<unsigned>((count * chunks_per_row + kThreads - 1) / kThreads);
    const hipError_t status = launch_kernel(kernel, blocks, kThreads, 0, stream, part,
                                            static_cast<uint32_t>(chunks_per_row));
    if (status != hipSuccess) return status;
  }
  return hipSuccess;
}

template <typename F>
hipError_t dispatch_float(Dtype dtype, const F& launch) {
  return dispatch_dtype(
      kFloatDtypes, dtype, [&](auto tag) { return launch(typename decltype(tag)::type{}); },
      [] { return hipErrorInvalidValue; });
}

}  // namespace

hipError_t launch_hc_gate_mix(const HcGateMixParams& p, hipStream_t stream) {
  return dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool whole = p.width % kVec == 0 && aligned_ptr(p.x) && aligned_ptr(p.gate) &&
                       aligned_ptr(p.out) && aligned16(p.x_row_stride * sizeof(T)) &&
                       aligned16(p.gate_row_stride * sizeof(T)) &&
                       aligned16(p.out_row_stride * sizeof(T));
    const auto shift = [&](HcGateMixParams& part, int64_t t0, int64_t count) {
      part.num_tokens = count;
      part.x = static_cast<const T*>(p.x) + t0 * p.x_row_stride;
      part.gate = static_cast<const T*>(p.gate) + t0 * p.gate_row_stride;
      part.out = static_cast<T*>(p.out) + t0 * p.out_row_stride;
    };
    return whole ? launch_chunks(hc_gate_mix_kernel<T, kVec>, p, p.num_tokens, p.width / kVec,
                                 stream, shift)
                 : launch_chunks(hc_gate_mix_kernel<T, 1>, p, p.num_tokens, p.width, stream, shift);
  });
}

hipError_t launch_hc_silu(const HcSiluParams& p, hipStream_t stream) {
  return dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool whole = p.width % kVec == 0 && aligned_ptr(p.x) && aligned_ptr(p.y) &&
                       aligned16(p.x_row_stride * sizeof(T)) &&
                       aligned16(p.y_row_stride * sizeof(T));
    const auto shift = [&](HcSiluParams& part, int64_t t0, int64_t count) {
      part.num_tokens = count;
      part.x = static_cast<const T*>(p.x) + t0 * p.x_row_stride;
      part.y = static_cast<T*>(p.y) + t0 * p.y_row_stride;
    };
    return whole ? launch_chunks(hc_silu_kernel<T, kVec>, p, p.num_tokens, p.width / kVec, stream,
                                 shift)
                 : launch_chunks(hc_silu_kernel<T, 1>, p, p.num_tokens, p.width, stream, shift);
  });
}

hipError_t launch_hc_combine(const HcCombineParams& p, hipStream_t stream) {
  return dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool whole =
        p.width % kVec == 0 && aligned_ptr(p.residual) && aligned_ptr(p.block_output) &&
        aligned_ptr(p.h) && aligned16(p.residual_row_stride * sizeof(T)) &&
        aligned16(p.block_row_stride * sizeof(T)) && aligned16(p.h_row_stride * sizeof(T));
    const int64_t columns = static_cast<int64_t>(p.width) * p.streams;
    const auto shift = [&](HcCombineParams& part, int64_t t0, int64_t count) {
      part.num_tokens = count;
      part.residual = static_cast<const T*>(p.residual) + t0 * p.residual_row_stride;
      part.block_output = static_cast<const T*>(p.block_output) + t0 * p.block_row_stride;
      if (p.injection_logits != nullptr) {
        part.injection_logits =
            static_cast<const T*>(p.injection_logits) + t0 * p.logits_row_stride;
      }
      part.h = static_cast<T*>(p.h) + t0 * p.h_row_stride;
    };
    return whole ? launch_chunks(hc_combine_kernel<T, kVec>, p, p.num_tokens, columns / kVec,
                                 stream, shift)
                 : launch_chunks(hc_combine_kernel<T, 1>, p, p.num_tokens, columns, stream, shift);
  });
}

}  // namespace qwen4exp
