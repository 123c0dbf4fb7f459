// The hyper-connection combine and norms (issue #50): hc_combine, hc_combine_norm and
// grouped_gemma_rmsnorm. The params structs shared by the CPU kernels, the HIP kernels and the
// host glue, and the launchers of the HIP kernels. Torch-free.
//
// Precision, as vLLM 0.33.0's Triton kernels (vllm/models/qwen4_exp/amd/ops/hc.py): every
// value read is widened to fp32 and every materialised tensor rounded to its dtype
// (round-to-nearest-even); injection = 2·sigmoid(logit / HC); h = round(residual + block ·
// injection); the norm sums the squares of the rounded h (or x), rrms = 1 / sqrt(Σ / G + eps),
// y = x·rrms, y += y·w.
#pragma once

#include "float_types.h"
#include "platform.h"

namespace qwen4exp {

// hc_combine (xn == nullptr, no norm) and hc_combine_norm, per token t and stream s < HC:
//   h[t, s·H + i] = round(residual[t, s·H + i] + block[t, i] · 2·sigmoid(logits[t, s] / HC))
//   xn[t, s·H + i] = round(Gemma RMSNorm over the H elements of h[t, s·H ...])
struct HcCombineParams {
  // Inputs (dtype), unit stride along the row, any non-negative row stride (elements):
  // residual [T, HC·H], block_output [T, H], injection_logits [T, HC] (a column slice of the
  // down-GEMM's output) or nullptr, an injection of 1 (vLLM's NVIDIA module's None).
  const void* residual;
  const void* block_output;
  const void* injection_logits;
  int64_t residual_row_stride;
  int64_t block_row_stride;
  int64_t logits_row_stride;
  // The norm's weight, contiguous in weight_dtype (fp32 or dtype): [H] shared by every stream
  // (weight_shared) or [HC·H] (hc_per_branch_norm's layout). Unused without xn.
  const void* norm_weight;
  // Outputs (dtype), unit stride along the row: h [T, HC·H], xn [T, HC·H] or nullptr.
  void* h;
  void* xn;
  int64_t h_row_stride;
  int64_t xn_row_stride;
  int64_t num_tokens;  // T
  int32_t width;       // H
  int32_t streams;     // HC
  float eps;
  bool weight_shared;
  Dtype dtype;
  Dtype weight_dtype;
};

// grouped_gemma_rmsnorm, per row r and group g < groups: y[r, g·G ...] = Gemma RMSNorm of the G
// elements x[r, g·G ...], weight [G] (weight_shared) or [groups·G].
struct HcRmsNormParams {
  const void* x;  // [rows, groups·G], unit stride along the row
  const void* weight;
  void* y;  // [rows, groups·G], unit stride along the row
  int64_t x_row_stride;
  int64_t y_row_stride;
  int64_t num_rows;
  int32_t width;   // G
  int32_t groups;  // num_groups
  float eps;
  bool weight_shared;
  Dtype dtype;
  Dtype weight_dtype;
};

// The CPU kernels (csrc/cpu/hc_norm.cpp), on the calling thread and the CPU kernels' threads;
// return when done. Expect H, G > 0 and host memory; T may be 0. The sums are numpy's pairwise
// order over vLLM's blocks (what Triton's interpreter computes). Throw std::invalid_argument on a
// dtype they have no kernel for.
QWEN4EXP_API void run_hc_combine_cpu(const HcCombineParams& p);
QWEN4EXP_API void run_hc_rmsnorm_cpu(const HcRmsNormParams& p);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueue the kernels on `stream`; return the launch status. Expect T > 0 and H, G > 0.
// hc_combine_norm (p.xn set) is csrc/hip/hc_norm.hip's; hc_combine, element-wise (p.xn unused),
// csrc/hip/hc_mix.hip's.
hipError_t launch_hc_combine_norm(const HcCombineParams& p, hipStream_t stream);
hipError_t launch_hc_combine(const HcCombineParams& p, hipStream_t stream);
hipError_t launch_hc_rmsnorm(const HcRmsNormParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
