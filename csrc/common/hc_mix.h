// The hyper-connection mixes (issue #50): hc_gate_mix and hc_silu. The params structs shared by
// the CPU kernels, the HIP kernels and the host glue, and the launchers of the HIP kernels.
// Torch-free.
//
// Precision, as vLLM 0.33.0's Triton kernels (vllm/models/qwen4_exp/amd/ops/hc.py): values
// widened to fp32, sigmoid(z) = 1 / (1 + exp(-z)) in fp32, outputs rounded to their dtype.
#pragma once

#include "float_types.h"
#include "platform.h"

namespace qwen4exp {

// hc_gate_mix, per token t and i < H:
//   out[t, i] = round((Σ_{s = 0..HC-1} sigmoid(gate[t, s·H + i]) · x[t, s·H + i]) / HC),
// the sum in fp32 from 0 in stream order.
struct HcGateMixParams {
  const void* x;     // [T, HC·H] (the normed streams), unit stride along the row
  const void* gate;  // [T, HC·H] (the up-GEMM's logits), unit stride along the row
  void* out;         // [T, H], unit stride along the row
  int64_t x_row_stride;
  int64_t gate_row_stride;
  int64_t out_row_stride;
  int64_t num_tokens;  // T
  int32_t width;       // H
  int32_t streams;     // HC
  Dtype dtype;
};

// hc_silu, per element: z = x / HC; y = round(z · sigmoid(z)).
struct HcSiluParams {
  const void* x;  // [T, D], unit stride along the row
  void* y;        // [T, D], unit stride along the row
  int64_t x_row_stride;
  int64_t y_row_stride;
  int64_t num_tokens;  // T
  int32_t width;       // D
  int32_t hc_count;    // HC, the divisor
  Dtype dtype;
};

// The CPU kernels (csrc/cpu/hc_mix.cpp), on the calling thread and the CPU kernels' threads;
// return when done. Expect H, D > 0 and host memory; T may be 0. Throw std::invalid_argument on a
// dtype they have no kernel for.
QWEN4EXP_API void run_hc_gate_mix_cpu(const HcGateMixParams& p);
QWEN4EXP_API void run_hc_silu_cpu(const HcSiluParams& p);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueue the kernels on `stream`; return the launch status. Expect T > 0 and H, D > 0.
hipError_t launch_hc_gate_mix(const HcGateMixParams& p, hipStream_t stream);
hipError_t launch_hc_silu(const HcSiluParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
