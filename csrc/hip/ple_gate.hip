// HIP kernel for ple_gate (SPEC §5). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// One block per token does all M streams of the token, so the token's value row is read once
// per stream from L2 at most, and the fast mode's Σvalue² is reduced once for all streams. Each
// thread handles chunks of 16 bytes' worth of elements (8 bf16/fp16 or 4 fp32), with one 128-bit
// access per chunk when the rows allow it and element by element otherwise; which elements a
// thread sums, and in what order, depends on H alone, so the result does not depend on how the
// rows are aligned. Per stream:
// - "vllm" rounding: Σk², Σq² (one block reduction); Σ round(round(k·r_k·(1+w_k))·round(q·r_q·
//   (1+w_q))) (a second); g; Σ round(g·v)² (a third); then the two outputs. The rounding points
//   are vLLM's; the summation order is a tree, not numpy's, so bf16/fp16 results can differ from
//   the CPU kernel by one unit in the last place where a sum lands next to a rounding boundary
//   (the tolerance tests/test_ple_gate.py states for every backend).
// - "fp32" rounding: Σk², Σq², Σk·q·(1+w_k)(1+w_q) in one reduction, then the outputs.
#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/ple_gate.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;

template <typename W>
QWEN4EXP_DEVICE float one_plus(const void* w, int64_t i) {
  return 1.0f + to_float(static_cast<const W*>(w)[i]);
}

QWEN4EXP_DEVICE float gate_of(float d, float magnitude) {
  const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
  return sigmoid_f32(sign * magnitude);
}

// Chunk c of a row of H elements: elements [c·VEC, c·VEC + VEC), those past H read as 0 (which
// leaves every sum as it is: the sums start at +0). kWhole: H is a multiple of VEC and the rows
// are 16-byte aligned, so a chunk is one 128-bit access.
template <typename T, int VEC, bool kWhole>
QWEN4EXP_DEVICE void load_chunk(const T* row, int c, int H, float (&out)[VEC]) {
  if constexpr (kWhole) {
    load_floats<T, VEC>(row + c * VEC, out);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = c * VEC + i < H ? to_float(row[c * VEC + i]) : 0.f;
  }
}

template <typename T, int VEC, bool kWhole>
QWEN4EXP_DEVICE void store_chunk(T* row, int c, int H, const float (&in)[VEC]) {
  if constexpr (kWhole) {
    store_floats<T, VEC>(row + c * VEC, in);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (c * VEC + i < H) row[c * VEC + i] = from_float<T>(in[i]);
    }
  }
}

// 1 + w of element i of chunk c of stream `base` (1 past the row: those elements are 0).
template <typename W, int VEC, bool kWhole>
QWEN4EXP_DEVICE float weight_at(const void* w, int64_t base, int c, int i, int H) {
  return (kWhole || c * VEC + i < H) ? one_plus<W>(w, base + c * VEC + i) : 1.0f;
}

template <typename T, typename W, bool kWhole, bool kVllm>
__global__ void __launch_bounds__(kThreads) ple_gate_kernel(PleGateParams p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int kWaves = kThreads / kWaveSize;
  QWEN4EXP_SHARED(float[3 * kWaves], scratch);
  const int H = p.width;
  const float h_f = static_cast<float>(H);
  const float sqrt_h = sqrtf(h_f);
  const int chunks = (H + VEC - 1) / VEC;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const T* key = static_cast<const T*>(p.key) + t * p.key_row_stride;
    const T* hidden = static_cast<const T*>(p.hidden) + t * p.hidden_row_stride;
    const T* value = static_cast<const T*>(p.value) + t * p.value_row_stride;
    T* gated = static_cast<T*>(p.gated) + t * p.gated_row_stride;
    T* conv = static_cast<T*>(p.conv_input) + t * p.conv_input_row_stride;

    float sum_vv = 0.f;
    if constexpr (!kVllm) {
      float acc[1] = {0.f};
      for (int c = threadIdx.x; c < chunks; c += kThreads) {
        float v[VEC];
        load_chunk<T, VEC, kWhole>(value, c, H, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[0] += v[i] * v[i];
      }
      block_sum<1, kThreads>(acc, scratch);
      sum_vv = acc[0];
    }

    for (int m = 0; m < p.streams; ++m) {
      const int64_t base = static_cast<int64_t>(m) * H;
      if constexpr (kVllm) {
        float sums[2] = {0.f, 0.f};
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float k[VEC], q[VEC];
          load_chunk<T, VEC, kWhole>(key + base, c, H, k);
          load_chunk<T, VEC, kWhole>(hidden + base, c, H, q);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            sums[0] += k[i] * k[i];
            sums[1] += q[i] * q[i];
          }
        }
        block_sum<2, kThreads>(sums, scratch);
        const float rk = 1.0f / sqrtf(sums[0] / h_f + p.eps);
        const float rq = 1.0f / sqrtf(sums[1] / h_f + p.eps);
        float dot[1] = {0.f};
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float k[VEC], q[VEC];
          load_chunk<T, VEC, kWhole>(key + base, c, H, k);
          load_chunk<T, VEC, kWhole>(hidden + base, c, H, q);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float kn =
                round_to<T>(k[i] * rk * weight_at<W, VEC, kWhole>(p.norm_key_w, base, c, i, H));
            const float qn =
                round_to<T>(q[i] * rq * weight_at<W, VEC, kWhole>(p.norm_query_w, base, c, i, H));
            dot[0] += round_to<T>(kn * qn);
          }
        }
        block_sum<1, kThreads>(dot, scratch);
        const float d = round_to<T>(round_to<T>(dot[0]) / sqrt_h);
        const float magnitude = round_to<T>(sqrtf(gate_magnitude_floor(d)));
        const float g = round_to<T>(gate_of(d, magnitude));
        float sum_gg[1] = {0.f};
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float v[VEC], out[VEC];
          load_chunk<T, VEC, kWhole>(value, c, H, v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            out[i] = round_to<T>(g * v[i]);
            sum_gg[0] += out[i] * out[i];
          }
          store_chunk<T, VEC, kWhole>(gated + base, c, H, out);
        }
        block_sum<1, kThreads>(sum_gg, scratch);
        const float rg = 1.0f / sqrtf(sum_gg[0] / h_f + p.eps);
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float v[VEC], out[VEC];
          load_chunk<T, VEC, kWhole>(value, c, H, v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            out[i] = round_to<T>(g * v[i]) * rg *
                     weight_at<W, VEC, kWhole>(p.norm_conv_w, base, c, i, H);
          }
          store_chunk<T, VEC, kWhole>(conv + base, c, H, out);
        }
      } else {
        float sums[3] = {0.f, 0.f, 0.f};
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float k[VEC], q[VEC];
          load_chunk<T, VEC, kWhole>(key + base, c, H, k);
          load_chunk<T, VEC, kWhole>(hidden + base, c, H, q);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float fused = weight_at<W, VEC, kWhole>(p.norm_key_w, base, c, i, H) *
                                weight_at<W, VEC, kWhole>(p.norm_query_w, base, c, i, H);
            sums[0] += k[i] * k[i];
            sums[1] += q[i] * q[i];
            sums[2] += k[i] * q[i] * fused;
          }
        }
        block_sum<3, kThreads>(sums, scratch);
        const float rk = 1.0f / sqrtf(sums[0] / h_f + p.eps);
        const float rq = 1.0f / sqrtf(sums[1] / h_f + p.eps);
        const float d = sums[2] * rk * rq / sqrt_h;
        const float g = gate_of(d, sqrtf(gate_magnitude_floor(d)));
        const float g_rg = g / sqrtf(g * g * sum_vv / h_f + p.eps);
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
          float v[VEC], out_g[VEC], out_c[VEC];
          load_chunk<T, VEC, kWhole>(value, c, H, v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            out_g[i] = g * v[i];
            out_c[i] = g_rg * v[i] * weight_at<W, VEC, kWhole>(p.norm_conv_w, base, c, i, H);
          }
          store_chunk<T, VEC, kWhole>(gated + base, c, H, out_g);
          store_chunk<T, VEC, kWhole>(conv + base, c, H, out_c);
        }
      }
    }
  }
}

template <typename T, typename W>
hipError_t launch_typed(const PleGateParams& p, hipStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool whole =
      p.width % kVec == 0 && aligned16(reinterpret_cast<uint64_t>(p.key)) &&
      aligned16(reinterpret_cast<uint64_t>(p.value)) &&
      aligned16(reinterpret_cast<uint64_t>(p.hidden)) &&
      aligned16(reinterpret_cast<uint64_t>(p.gated)) &&
      aligned16(reinterpret_cast<uint64_t>(p.conv_input)) &&
      aligned16(p.key_row_stride * sizeof(T)) && aligned16(p.value_row_stride * sizeof(T)) &&
      aligned16(p.hidden_row_stride * sizeof(T)) && aligned16(p.gated_row_stride * sizeof(T)) &&
      aligned16(p.conv_input_row_stride * sizeof(T));
  const dim3 grid(static_cast<unsigned>(p.num_tokens < kMaxGridX ? p.num_tokens : kMaxGridX));
  const auto launch = [&](auto kernel) {
    return launch_kernel(kernel, grid, kThreads, 0, stream, p);
  };
  const bool vllm = p.rounding == GateRounding::kVllm;
  if (whole) {
    return vllm ? launch(ple_gate_kernel<T, W, true, true>)
                : launch(ple_gate_kernel<T, W, true, false>);
  }
  return vllm ? launch(ple_gate_kernel<T, W, false, true>)
              : launch(ple_gate_kernel<T, W, false, false>);
}

}  // namespace

hipError_t launch_ple_gate(const PleGateParams& p, hipStream_t stream) {
  return dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        // The weights are fp32 or the activations' own dtype.
        return p.weight_dtype == Dtype::kF32 ? launch_typed<T, float>(p, stream)
                                             : launch_typed<T, T>(p, stream);
      },
      [] { return hipErrorInvalidValue; });
}

}  // namespace qwen4exp
