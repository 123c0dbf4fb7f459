// ple_conv (SPEC §6): the params struct shared by the CPU kernel, the HIP kernels and the host
// glue, the helpers both backends use to walk a batch, and the launcher of the HIP kernels.
// Torch-free.
#pragma once

#include "float_types.h"
#include "index_view.h"
#include "platform.h"

namespace qwen4exp {

// vLLM's NULL_BLOCK_ID: state slot 0 is padding, never read or written.
constexpr int64_t kNullSlot = 0;
// Largest kernel size and dilation the kernels take (the released model: 4 and 3).
constexpr int kMaxConvKernel = 8;
constexpr int kMaxConvDilation = 8;

enum class ConvMode : int32_t { kDecode = 0, kPrefill = 1, kSpec = 2 };

struct PleConvParams {
  // inputs, residual and outer_residual: rows of C channels (unit channel stride); physical row
  // i at i·row_stride. outer_residual may be null (no fused residual).
  const void* inputs;
  void* residual;
  const void* outer_residual;
  int64_t inputs_row_stride;
  int64_t residual_row_stride;
  int64_t outer_row_stride;
  // conv_state [slots, C, W]: entry (slot, c, w) at slot·slot_stride + c·channel_stride +
  // w·window_stride (window-first storage is the transposed view: channel_stride 1).
  void* conv_state;
  int64_t state_slot_stride;
  int64_t state_channel_stride;
  int64_t state_window_stride;
  int64_t num_slots;
  int64_t state_width;  // W
  // conv_weights [C, K], any strides, in weight_dtype (fp32 or the activations' dtype).
  const void* weights;
  int64_t weight_channel_stride;
  int64_t weight_tap_stride;
  IndexView state_indices;        // [R] (decode: [>= T], one per token)
  IndexView query_start_loc;      // [R + 1] (prefill, spec)
  IndexView num_accepted_tokens;  // [R] (spec)
  IndexView has_initial_states;   // [R] or absent (decode: optional, spec: ignored)
  IndexView token_indices;        // [T] logical -> physical row, or absent (identity)
  int64_t num_rows;               // T: logical rows (token_indices.numel() or inputs rows)
  int64_t num_physical_rows;      // rows of inputs / residual / outer_residual
  int64_t channels;               // C
  int64_t num_requests;           // R (decode: T)
  int32_t kernel_size;            // K
  int32_t dilation;               // δ
  int32_t state_len;              // S = (K - 1)·δ
  int32_t query_len;              // q: spec_query_len in spec mode, else 1
  ConvMode mode;
  Dtype dtype;         // inputs, residual, outer_residual and conv_state
  Dtype weight_dtype;  // conv_weights
};

// Physical row of logical row t, or -1 when the token map sends it out of range.
QWEN4EXP_HD int64_t conv_physical_row(const PleConvParams& p, int64_t t) {
  if (!p.token_indices.present()) return t;
  const int64_t row = p.token_indices[t];
  return (row >= 0 && row < p.num_physical_rows) ? row : int64_t{-1};
}

// The spec read offset: the window starts at the last accepted token's slot column.
QWEN4EXP_HD int64_t conv_spec_offset(const PleConvParams& p, int64_t r) {
  int64_t offset = p.num_accepted_tokens[r] - 1;
  offset = offset < 0 ? 0 : offset;
  return offset > p.query_len - 1 ? p.query_len - 1 : offset;
}

// The CPU kernel (csrc/cpu/ple_conv.cpp), on the calling thread and the CPU kernels' threads;
// returns when done. Expects what launch_ple_conv expects (T or R may be 0), in host memory.
// Throws std::invalid_argument on a dtype it has no kernel for.
QWEN4EXP_API void run_ple_conv_cpu(const PleConvParams& p);

// How the 16-bit CPU conv looks its SiLU up: kConvSiluLoop (one load per element) or
// kConvSiluGather (AVX-512 gathers, where the CPU has them). By default the first call that asks
// times both on this CPU and keeps the faster; set_cpu_conv_silu_lookup pins one (kConvSiluTimed:
// the default) and returns the setting it replaces. It throws std::invalid_argument on any other
// value, and on kConvSiluGather where the CPU or build has no AVX-512.
constexpr int64_t kConvSiluTimed = -1;
constexpr int64_t kConvSiluLoop = 0;
constexpr int64_t kConvSiluGather = 1;
QWEN4EXP_API int64_t cpu_conv_silu_lookup();
QWEN4EXP_API int64_t set_cpu_conv_silu_lookup(int64_t lookup);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the conv (outputs, then the state write-back for prefill/spec) on `stream`; returns the
// launch status (hipErrorInvalidValue, launching nothing, past 65535·256·VEC channels: one block
// row per channel group of 256·VEC, where VEC is 1 for the prefill/spec write-back and for rows
// or a decode state that allow no vector access). Expects T > 0 or, for prefill/spec, R > 0.
hipError_t launch_ple_conv(const PleConvParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
