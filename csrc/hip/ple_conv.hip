// HIP kernels for ple_conv (SPEC §6). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// Outputs: one block row per logical token (a block takes several past 65536 tokens), each thread
// 8 channels (one 128-bit access per row for bf16/fp16; 4 for fp32) when the rows allow it, else
// one. A thread reads its K taps (state
// entries or input rows), rounds the sum, applies SiLU and the fused residuals, and writes the
// residual row; in decode it then shifts its own channels of the window (no other thread reads
// them). Prefill and spec write the state back in a second kernel, after every token has read
// the old state, one block row per request.
//
// The host cannot see the data, so every index taken from it is checked here: a token whose
// token_indices entry is out of range is skipped (its residual row is not written); a slot id
// outside [0, slots) is treated as the null slot (no state read or written, output 0 in decode
// and prefill); query starts that run backwards or past the batch produce no output and no
// write-back; taps whose input row falls outside the batch read 0. Nothing reads or writes out
// of bounds, whatever the indices hold.
#include <type_traits>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/ple_conv.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;

template <typename T>
QWEN4EXP_DEVICE T* state_at(const PleConvParams& p, int64_t slot, int64_t w, int64_t c) {
  return static_cast<T*>(p.conv_state) + slot * p.state_slot_stride + w * p.state_window_stride +
         c * p.state_channel_stride;
}

QWEN4EXP_DEVICE bool slot_in_range(const PleConvParams& p, int64_t slot) {
  return slot >= 0 && slot < p.num_slots;
}

// Calls body(index, c0) for every index < count (blocks along x, looping past the grid) and this
// thread's first channel c0 < C. The launcher gives every channel group a block along y, so a
// thread keeps one c0 for the whole launch: a loop over channel groups too kept enough uniform
// values live to spill SGPRs on AMD.
template <int VEC, typename Body>
QWEN4EXP_DEVICE void for_each_row_and_channels(const PleConvParams& p, int64_t count, Body body) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * VEC;
  if (c0 >= p.channels) return;
  for (int64_t index = blockIdx.x; index < count; index += gridDim.x) {
    body(index, c0);
  }
}

// Logical row t, channels [c0, c0 + VEC).
template <typename T, typename W, int VEC, ConvMode kMode>
QWEN4EXP_DEVICE void conv_output(const PleConvParams& p, int64_t t, int64_t c0) {
  const int64_t row = conv_physical_row(p, t);
  if (row < 0) return;
  const int S = p.state_len;

  bool produce = false, read = false, live = false, init = true;
  int64_t slot = kNullSlot, start = t, offset = 0;
  if constexpr (kMode == ConvMode::kDecode) {
    slot = p.state_indices[t];
    live = slot != kNullSlot && slot_in_range(p, slot);
    init = !p.has_initial_states.present() || p.has_initial_states[t] != 0;
    read = live && init;
    produce = live;
  } else if (p.num_requests > 0) {
    const IndexView& qsl = p.query_start_loc;
    const int64_t r = find_request(qsl, p.num_requests, t);
    start = qsl[r];
    const bool in_range = t >= start && t < qsl[p.num_requests];
    slot = p.state_indices[r];
    live = slot != kNullSlot && slot_in_range(p, slot);
    if constexpr (kMode == ConvMode::kSpec) {
      read = live;
      produce = in_range;
      offset = conv_spec_offset(p, r);
    } else {
      read = live && p.has_initial_states[r] != 0;
      produce = in_range && live;
    }
  }

  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  if (produce) {
    const int64_t j = t - start;
    const W* weights = static_cast<const W*>(p.weights);
    for (int k = 0; k < p.kernel_size; ++k) {
      const int64_t h = j + static_cast<int64_t>(k) * p.dilation;
      float tap[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) tap[v] = 0.f;
      if (h < S) {
        if (read) {
#pragma unroll
          for (int v = 0; v < VEC; ++v)
            tap[v] = to_float(*state_at<T>(p, slot, offset + h, c0 + v));
        }
      } else {
        const int64_t logical = start + h - S;
        const int64_t src = (logical >= 0 && logical < p.num_rows) ? conv_physical_row(p, logical)
                                                                   : int64_t{-1};
        if (src >= 0) {
          load_floats<T, VEC>(static_cast<const T*>(p.inputs) + src * p.inputs_row_stride + c0,
                              tap);
        }
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float w =
            to_float(weights[(c0 + v) * p.weight_channel_stride + k * p.weight_tap_stride]);
        acc[v] += w * tap[v];
      }
    }
  }

  // The conv sum is rounded to the storage dtype before SiLU (F.conv1d materialises it).
  float y[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float conv = round_to<T>(acc[v]);
    y[v] = produce ? round_to<T>(conv * sigmoid_f32(conv)) : 0.f;
  }
  T* residual = static_cast<T*>(p.residual) + row * p.residual_row_stride + c0;
  if (p.outer_residual != nullptr) {
    float res[VEC], outer[VEC];
    load_floats<T, VEC>(residual, res);
    load_floats<T, VEC>(static_cast<const T*>(p.outer_residual) + row * p.outer_row_stride + c0,
                        outer);
#pragma unroll
    for (int v = 0; v < VEC; ++v) y[v] = outer[v] + round_to<T>(res[v] + y[v]);
  }
  store_floats<T, VEC>(residual, y);

  if (kMode == ConvMode::kDecode && live && S > 0) {  // folds away outside decode
    // Shift this thread's channels of the window by one and append x (zeros without an
    // initial state). Entry i reads entry i + 1 before anything writes it.
    for (int i = 0; i + 1 < S; ++i) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        *state_at<T>(p, slot, i, c0 + v) = init ? *state_at<T>(p, slot, i + 1, c0 + v)
                                                : from_float<T>(0.0f);
      }
    }
    float x[VEC];
    load_floats<T, VEC>(static_cast<const T*>(p.inputs) + row * p.inputs_row_stride + c0, x);
#pragma unroll
    for (int v = 0; v < VEC; ++v) *state_at<T>(p, slot, S - 1, c0 + v) = from_float<T>(x[v]);
  }
}

template <typename T, typename W, int VEC, ConvMode kMode>
__global__ void __launch_bounds__(kThreads) ple_conv_outputs_kernel(PleConvParams p) {
  for_each_row_and_channels<VEC>(
      p, p.num_rows, [&](int64_t t, int64_t c0) { conv_output<T, W, VEC, kMode>(p, t, c0); });
}

// Request r's new state, channels [c0, c0 + VEC).
template <typename T, int VEC, ConvMode kMode>
QWEN4EXP_DEVICE void conv_write_back(const PleConvParams& p, int64_t r, int64_t c0) {
  const int64_t slot = p.state_indices[r];
  if (slot == kNullSlot || !slot_in_range(p, slot)) return;
  const int64_t start = p.query_start_loc[r];
  const int64_t end = p.query_start_loc[r + 1];
  if (start < 0 || end < start || end > p.num_rows) return;
  const int S = p.state_len;
  const int64_t qlen = end - start;
  int64_t shift, offset = 0, count;
  bool init = true;
  if constexpr (kMode == ConvMode::kSpec) {
    // Entries [0, S-1+qlen) become old[o+1 : o+S] ++ chunk; the unused tail is kept.
    shift = 1;
    offset = conv_spec_offset(p, r);
    count = S - 1 + qlen;
    if (count > S + p.query_len - 1) count = S + p.query_len - 1;
  } else {
    if (qlen <= 0) return;  // an empty request keeps its state
    shift = qlen;
    count = S;
    init = p.has_initial_states[r] != 0;
  }
  // Ascending entries: entry i reads entry offset + shift + i > i, not yet written.
  for (int64_t i = 0; i < count; ++i) {
    const int64_t m = shift + i;
    float value[VEC];
    if (m < S) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        value[v] = init ? to_float(*state_at<T>(p, slot, offset + m, c0 + v)) : 0.f;
      }
    } else {
      const int64_t src = conv_physical_row(p, start + m - S);
      if (src < 0) continue;
      load_floats<T, VEC>(static_cast<const T*>(p.inputs) + src * p.inputs_row_stride + c0, value);
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) *state_at<T>(p, slot, i, c0 + v) = from_float<T>(value[v]);
  }
}

template <typename T, int VEC, ConvMode kMode>
__global__ void __launch_bounds__(kThreads) ple_conv_write_back_kernel(PleConvParams p) {
  for_each_row_and_channels<VEC>(
      p, p.num_requests, [&](int64_t r, int64_t c0) { conv_write_back<T, VEC, kMode>(p, r, c0); });
}

template <typename T, typename W, int VEC>
hipError_t launch_vec(const PleConvParams& p, hipStream_t stream) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * VEC;
  const int64_t channel_blocks = (p.channels + per_block - 1) / per_block;
  // More than 65535 · 256 · VEC channels (16.7 million at VEC = 1) are not launched.
  if (channel_blocks > kMaxGridY) return hipErrorInvalidValue;
  const auto grid = [&](int64_t count) {
    return dim3(static_cast<unsigned>(count < kMaxGridX ? count : kMaxGridX),
                static_cast<unsigned>(channel_blocks));
  };
  // Each mode is its own kernel: a kernel with all three keeps every mode's values live.
  const auto launch_mode = [&](auto mode) -> hipError_t {
    constexpr ConvMode kMode = decltype(mode)::value;
    if (p.num_rows > 0) {
      const hipError_t status = launch_kernel(ple_conv_outputs_kernel<T, W, VEC, kMode>,
                                              grid(p.num_rows), kThreads, 0, stream, p);
      if (status != hipSuccess) return status;
    }
    if constexpr (kMode != ConvMode::kDecode) {
      if (p.num_requests > 0) {
        return launch_kernel(ple_conv_write_back_kernel<T, VEC, kMode>, grid(p.num_requests),
                             kThreads, 0, stream, p);
      }
    }
    return hipSuccess;
  };
  switch (p.mode) {
    case ConvMode::kDecode:
      return launch_mode(std::integral_constant<ConvMode, ConvMode::kDecode>{});
    case ConvMode::kPrefill:
      return launch_mode(std::integral_constant<ConvMode, ConvMode::kPrefill>{});
    case ConvMode::kSpec: return launch_mode(std::integral_constant<ConvMode, ConvMode::kSpec>{});
  }
  return hipErrorInvalidValue;
}

template <typename T, typename W>
hipError_t launch_typed(const PleConvParams& p, hipStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.channels % kVec == 0 && aligned16(reinterpret_cast<uint64_t>(p.inputs)) &&
                   aligned16(reinterpret_cast<uint64_t>(p.residual)) &&
                   aligned16(reinterpret_cast<uint64_t>(p.outer_residual)) &&
                   aligned16(p.inputs_row_stride * sizeof(T)) &&
                   aligned16(p.residual_row_stride * sizeof(T)) &&
                   aligned16(p.outer_row_stride * sizeof(T));
  return vec ? launch_vec<T, W, kVec>(p, stream) : launch_vec<T, W, 1>(p, stream);
}

}  // namespace

hipError_t launch_ple_conv(const PleConvParams& p, hipStream_t stream) {
  if (p.channels == 0)
    return hipSuccess;  // nothing to compute or keep (a GPU refuses an empty grid)
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
