// ple_gate (SPEC §5): the params struct shared by the CPU kernel, the HIP kernel and the host
// glue, and the launcher of the HIP kernel. Torch-free.
#pragma once

#include "float_types.h"
#include "platform.h"

namespace qwen4exp {

// Streams of width H of one token are reduced in fp32; "vllm" rounding reproduces vLLM 0.33.0's
// rounding points (normed key and query, their products, the dot, d, |d|^½, g and gated, in the
// storage dtype), "fp32" keeps every intermediate in fp32 and rounds only the two outputs.
enum class GateRounding : int32_t { kVllm = 0, kFp32 = 1 };

// max(|d|, 1e-6) of SPEC §5, a NaN d staying NaN as it does in torch's clamp_min (and so in the
// reference and transformers): fmaxf would return 1e-6 and give a NaN row a finite gate.
QWEN4EXP_HD float gate_magnitude_floor(float d) {
  const float a = fabsf(d);
  return a < 1e-6f ? 1e-6f : a;
}

struct PleGateParams {
  // Activations (dtype): key [T, C] and hidden [T, C], value [T, H]; unit stride along the row,
  // any row stride (key and value are usually column slices of one [T, C + H] projection).
  const void* key;
  const void* value;
  const void* hidden;
  int64_t key_row_stride;  // elements
  int64_t value_row_stride;
  int64_t hidden_row_stride;
  // Gemma RMSNorm weights [C], contiguous, in weight_dtype (fp32 or the activations' dtype).
  const void* norm_key_w;
  const void* norm_query_w;
  const void* norm_conv_w;
  // Outputs [T, C] (dtype), unit stride along the row.
  void* gated;
  void* conv_input;
  int64_t gated_row_stride;
  int64_t conv_input_row_stride;
  int64_t num_tokens;  // T
  int32_t width;       // H
  int32_t streams;     // M = C / H
  float eps;
  Dtype dtype;
  Dtype weight_dtype;
  GateRounding rounding;
};

// The CPU kernel (csrc/cpu/ple_gate.cpp), on the calling thread and the CPU kernels' threads;
// returns when done. Expects H > 0 and host memory; T may be 0. Throws std::invalid_argument on a
// weight dtype it has no kernel for.
QWEN4EXP_API void run_ple_gate_cpu(const PleGateParams& p);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the gate on `stream`; returns the launch status. Expects T > 0 and H > 0.
hipError_t launch_ple_gate(const PleGateParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
