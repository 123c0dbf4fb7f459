// HIP kernels for hc_combine_norm and grouped_gemma_rmsnorm (csrc/common/hc_norm.h, issue #50).
// Compiled by hipcc for AMD and by nvcc (through platform.h) for NVIDIA.
//
// The work is per row to normalise, as in vLLM's kernels: a (token, stream) of hc_combine_norm, a
// (row, group) of grouped_gemma_rmsnorm. A group of 2^group_log2 threads takes one, the smallest
// power of two that holds its row in registers at kSlots chunks a lane (a chunk is 16 bytes: one
// 128-bit access where the rows and H allow it, else element by element), at most the whole block
// (H = 2560 in bf16: 256 threads, two chunks a lane). Each lane loads its chunks, computes (and,
// combining, stores h), and sums the squares; the group sum is block_reduce.h's (wave
// shuffles, shared memory only where a group spans waves); the norm is then written from the
// registers. Rows too long for the block's registers are taken in tiles, the norm reading each
// tile again (h from the output the same lane wrote). The sum is a tree, not Triton's (numpy's
// order under the interpreter): results can differ from the CPU kernels by one unit in the last
// place of their dtype (the tolerance tests/hc_combine_norm/ states); everything else is vLLM's
// expression order, with no a·b+c contracted (setup.py's device flags) and sigmoid_f32.
#include <algorithm>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/hc_norm.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;
// The fewest waves per SIMD on AMD: the op's floor in tools/kernel_report.py (FLOORS), held by
// register allocation (QWEN4EXP_AMD_MIN_WAVES).
constexpr int kAmdMinWaves = 8;
constexpr int kSlots = 2;  // chunks of the row a lane holds per tile

// log2 of the threads per row of `chunks` chunks.
QWEN4EXP_HD int group_log2_for(int chunks) {
  int log2 = 0;
  while ((kSlots << log2) < chunks && (2 << log2) <= kThreads) ++log2;
  return log2;
}

// Chunk c of a row of `width` elements as VEC fp32 values (VEC = 16 bytes of T): kWhole, one
// aligned 128-bit load (the row, its stride and the width allow it); else element by element,
// zeros past the width. Either way a lane holds the same elements in the same order, so the sums
// (and the results) depend on the width alone, not on how the rows are aligned.
template <typename T, int VEC, bool kWhole>
QWEN4EXP_DEVICE void load_chunk(const T* row, int c, int width, float (&out)[VEC]) {
  if constexpr (kWhole) {
    load_floats<T, VEC>(row + c * VEC, out);
  } else {
    // One address, and one test unless the chunk ends past the width (per-element tests and
    // addresses cost the AMD kernels registers they then spilled, as ple_gate.hip found).
    const T* src = row + c * VEC;
    const int n = width - c * VEC;
    if (n >= VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = widen(src[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = i < n ? widen(src[i]) : 0.f;
    }
  }
}

template <typename T, int VEC, bool kWhole>
QWEN4EXP_DEVICE void store_chunk(T* row, int c, int width, const float (&in)[VEC]) {
  if constexpr (kWhole) {
    store_floats<T, VEC>(row + c * VEC, in);
  } else {
    T* dst = row + c * VEC;  // as load_chunk: one address, one test unless the chunk ends early
    const int n = width - c * VEC;
    if (n >= VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) dst[i] = narrow<T>(in[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (i < n) dst[i] = narrow<T>(in[i]);
      }
    }
  }
}

// The chunk's VEC weights as fp32: fp32 weights of a 16-bit row are two 128-bit loads.
template <typename W, int VEC, bool kWhole>
QWEN4EXP_DEVICE void load_weight_chunk(const W* w, int c, int width, float (&out)[VEC]) {
  if constexpr (!kWhole || VEC * sizeof(W) == 16) {
    load_chunk<W, VEC, kWhole>(w, c, width, out);
  } else {
    static_assert(sizeof(W) == 4 && VEC == 8, "fp32 weights of a 16-bit row");
    float lo[4], hi[4];
    load_floats<W, 4>(w + c * VEC, lo);
    load_floats<W, 4>(w + c * VEC + 4, hi);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[i] = lo[i];
      out[4 + i] = hi[i];
    }
  }
}

// Where a group's row is, for either op: kCombine reads residual + block·injection (and writes
// h), otherwise x.
struct RowJob {
  const void* src;     // residual or x: the row of G elements
  const void* block;   // block_output (kCombine)
  void* h;             // kCombine: where h is written
  void* y;             // the norm's output
  const void* weight;  // the row's weights
  float injection;     // kCombine
};

// One row per group of 2^group_log2 threads: the shared body of both kernels.
template <typename T, typename W, bool kWhole, bool kCombine>
QWEN4EXP_DEVICE void norm_row(const RowJob& job, int width, float eps, int live_chunks,
                              int group_log2, float* scratch) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  const int group_size = 1 << group_log2;
  const int lane = static_cast<int>(threadIdx.x) & (group_size - 1);
  const int tile_chunks = kSlots << group_log2;
  const int chunks = (width + VEC - 1) / VEC;
  const int tiles = (chunks + tile_chunks - 1) / tile_chunks;
  const T* src = static_cast<const T*>(job.src);
  const T* block = static_cast<const T*>(job.block);
  T* h = static_cast<T*>(job.h);
  T* y = static_cast<T*>(job.y);
  const W* weight = static_cast<const W*>(job.weight);

  float held[kSlots][VEC];
  float sum[1] = {0.f};
  for (int r = 0; r < tiles; ++r) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int c = r * tile_chunks + s * group_size + lane;
      if (c >= live_chunks) continue;
      load_chunk<T, VEC, kWhole>(src, c, width, held[s]);
      if constexpr (kCombine) {
        float b[VEC];
        load_chunk<T, VEC, kWhole>(block, c, width, b);
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          held[s][i] = round_through<T>(held[s][i] + b[i] * job.injection);
        store_chunk<T, VEC, kWhole>(h, c, width, held[s]);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum[0] += held[s][i] * held[s][i];
    }
  }
  group_sum<1, kThreads>(sum, group_log2, scratch);
  const float rrms = 1.0f / sqrtf(sum[0] / static_cast<float>(width) + eps);
  for (int r = 0; r < tiles; ++r) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int c = r * tile_chunks + s * group_size + lane;
      if (c >= live_chunks) continue;
      if (tiles > 1) load_chunk<T, VEC, kWhole>(kCombine ? h : src, c, width, held[s]);
      float w[VEC], out[VEC];
      load_weight_chunk<W, VEC, kWhole>(weight, c, width, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float v = held[s][i] * rrms;
        out[i] = v + v * w[i];
      }
      store_chunk<T, VEC, kWhole>(y, c, width, out);
    }
  }
}

template <typename T, typename W, bool kWhole>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_combine_norm_kernel(HcCombineParams p, int group_log2) {
  constexpr int kWaves = kThreads / kWaveSize;
  QWEN4EXP_SHARED(float[kWaves], scratch);
  const uint32_t streams = static_cast<uint32_t>(p.streams);
  const uint32_t item = blockIdx.x * (kThreads >> group_log2) + (threadIdx.x >> group_log2);
  // A group past the last (token, stream) runs along with no chunks, for the group sum's barriers.
  const bool live = item < static_cast<uint64_t>(p.num_tokens) * streams;
  const int H = p.width;
  const uint32_t t = item / streams;
  const uint32_t s = item - t * streams;
  const int64_t base = static_cast<int64_t>(s) * H;
  RowJob job;
  job.src = static_cast<const T*>(p.residual) + t * p.residual_row_stride + base;
  job.block = static_cast<const T*>(p.block_output) + t * p.block_row_stride;
  job.h = static_cast<T*>(p.h) + t * p.h_row_stride + base;
  job.y = static_cast<T*>(p.xn) + t * p.xn_row_stride + base;
  job.weight = static_cast<const W*>(p.norm_weight) + (p.weight_shared ? 0 : base);
  job.injection = 0.f;
  if (!live) {
  } else if (p.injection_logits == nullptr) {
    job.injection = 1.0f;  // vLLM's NVIDIA module: the block output as it is
  } else {
    const T* logits = static_cast<const T*>(p.injection_logits) + t * p.logits_row_stride;
    job.injection = 2.0f * sigmoid_f32(widen(logits[s]) / static_cast<float>(p.streams));
  }
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  norm_row<T, W, kWhole, true>(job, H, p.eps, live ? (H + VEC - 1) / VEC : 0, group_log2, scratch);
}

template <typename T, typename W, bool kWhole>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_rmsnorm_kernel(HcRmsNormParams p, int group_log2) {
  constexpr int kWaves = kThreads / kWaveSize;
  QWEN4EXP_SHARED(float[kWaves], scratch);
  const uint32_t groups = static_cast<uint32_t>(p.groups);
  const uint32_t item = blockIdx.x * (kThreads >> group_log2) + (threadIdx.x >> group_log2);
  const bool live = item < static_cast<uint64_t>(p.num_rows) * groups;
  const int G = p.width;
  const uint32_t row = item / groups;
  const uint32_t g = item - row * groups;
  const int64_t base = static_cast<int64_t>(g) * G;
  RowJob job;
  job.src = static_cast<const T*>(p.x) + row * p.x_row_stride + base;
  job.block = nullptr;
  job.h = nullptr;
  job.y = static_cast<T*>(p.y) + row * p.y_row_stride + base;
  job.weight = static_cast<const W*>(p.weight) + (p.weight_shared ? 0 : base);
  job.injection = 0.f;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  norm_row<T, W, kWhole, false>(job, G, p.eps, live ? (G + VEC - 1) / VEC : 0, group_log2, scratch);
}

bool aligned_ptr(const void* ptr) { return aligned16(reinterpret_cast<uint64_t>(ptr)); }

// Launches `kernel` over items rows in parts of at most kMaxGridX blocks, shift(part, first,
// count) setting a part's rows (whole tokens: the rows of a token are `per_token` items).
template <typename P, typename Kernel, typename Shift>
hipError_t launch_rows(Kernel kernel, const P& p, int64_t tokens, int64_t per_token, int group_log2,
                       hipStream_t stream, const Shift& shift) {
  const int64_t per_launch = kMaxGridX * (kThreads >> group_log2) / per_token;
  for (int64_t t0 = 0; t0 < tokens; t0 += per_launch) {
    P part = p;
    const int64_t count = std::min(per_launch, tokens - t0);
    shift(part, t0, count);
    const int64_t threads = count * per_token << group_log2;
    const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
    const hipError_t status = launch_kernel(kernel, blocks, kThreads, 0, stream, part, group_log2);
    if (status != hipSuccess) return status;
  }
  return hipSuccess;
}

template <typename T, typename W, bool kWhole>
hipError_t launch_combine_norm(const HcCombineParams& p, hipStream_t stream) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  const int group_log2 = group_log2_for((p.width + VEC - 1) / VEC);
  return launch_rows(
      hc_combine_norm_kernel<T, W, kWhole>, p, p.num_tokens, p.streams, group_log2, stream,
      [&](HcCombineParams& part, int64_t t0, int64_t count) {
        part.num_tokens = count;
        part.residual = static_cast<const T*>(p.residual) + t0 * p.residual_row_stride;
        part.block_output = static_cast<const T*>(p.block_output) + t0 * p.block_row_stride;
        if (p.injection_logits != nullptr) {
          part.injection_logits =
              static_cast<const T*>(p.injection_logits) + t0 * p.logits_row_stride;
        }
        part.h = static_cast<T*>(p.h) + t0 * p.h_row_stride;
        part.xn = static_cast<T*>(p.xn) + t0 * p.xn_row_stride;
      });
}

template <typename T, typename W, bool kWhole>
hipError_t launch_rmsnorm(const HcRmsNormParams& p, hipStream_t stream) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  const int group_log2 = group_log2_for((p.width + VEC - 1) / VEC);
  return launch_rows(hc_rmsnorm_kernel<T, W, kWhole>, p, p.num_rows, p.groups, group_log2, stream,
                     [&](HcRmsNormParams& part, int64_t r0, int64_t count) {
                       part.num_rows = count;
                       part.x = static_cast<const T*>(p.x) + r0 * p.x_row_stride;
                       part.y = static_cast<T*>(p.y) + r0 * p.y_row_stride;
                     });
}

// The dtype pair's launch, with 128-bit chunks where every row, stride and weight allows them.
template <typename Launch>
hipError_t dispatch_norm(Dtype dtype, Dtype weight_dtype, const Launch& launch) {
  return dispatch_dtype(
      kFloatDtypes, dtype,
      [&](auto tag) {
        using T = typename decltype(tag)::type;
        // The weights are fp32 or the activations' own dtype.
        return weight_dtype == Dtype::kF32 ? launch(T{}, float{}) : launch(T{}, T{});
      },
      [] { return hipErrorInvalidValue; });
}

}  // namespace

hipError_t launch_hc_combine_norm(const HcCombineParams& p, hipStream_t stream) {
  return dispatch_norm(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    constexpr int kVec = 16 / sizeof(T);
    const bool whole =
        p.width % kVec == 0 && aligned_ptr(p.residual) && aligned_ptr(p.block_output) &&
        aligned_ptr(p.h) && aligned_ptr(p.xn) && aligned_ptr(p.norm_weight) &&
        aligned16(p.residual_row_stride * sizeof(T)) && aligned16(p.block_row_stride * sizeof(T)) &&
        aligned16(p.h_row_stride * sizeof(T)) && aligned16(p.xn_row_stride * sizeof(T));
    return whole ? launch_combine_norm<T, W, true>(p, stream)
                 : launch_combine_norm<T, W, false>(p, stream);
  });
}

hipError_t launch_hc_rmsnorm(const HcRmsNormParams& p, hipStream_t stream) {
  return dispatch_norm(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    constexpr int kVec = 16 / sizeof(T);
    const bool whole = p.width % kVec == 0 && aligned_ptr(p.x) && aligned_ptr(p.y) &&
                       aligned_ptr(p.weight) && aligned16(p.x_row_stride * sizeof(T)) &&
                       aligned16(p.y_row_stride * sizeof(T));
    return whole ? launch_rmsnorm<T, W, true>(p, stream) : launch_rmsnorm<T, W, false>(p, stream);
  });
}

}  // namespace qwen4exp
