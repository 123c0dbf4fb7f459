// Argument checks and params for hc_combine, hc_combine_norm and grouped_gemma_rmsnorm
// (csrc/common/hc_norm.h), shared by the CPU and GPU entry points so that both reject the same
// inputs with the same messages.
#pragma once

#include <optional>

#include "../../common/hc_norm.h"
#include "hc_args.h"

namespace qwen4exp {

// residual [T, HC·H], block_output [T, H], injection_logits [T, HC]; the norm weight when `op` is
// hc_combine_norm (norm_weight non-null). Everything but the outputs.
inline HcCombineParams check_hc_combine_args(const char* op, const at::Tensor& residual,
                                             const at::Tensor& block_output,
                                             const std::optional<at::Tensor>& injection_logits,
                                             const at::Tensor* norm_weight, double eps,
                                             int64_t hc_count) {
  using namespace hc_args;
  HcCombineParams p{};
  p.dtype = activation_dtype(op, "residual", residual);
  check_rows_like(op, {"residual", &residual}, {{"block_output", &block_output}});
  if (injection_logits) {
    check_rows_like(op, {"residual", &residual}, {{"injection_logits", &*injection_logits}});
  }
  p.streams = check_hc_count(op, "hc_count", hc_count);
  const int64_t num_tokens = residual.size(0);
  p.width = part_width(op, "residual's last dim HC·H", residual.size(1), hc_count, "hc_count");
  TORCH_CHECK(block_output.size(0) == num_tokens && block_output.size(1) == p.width, op,
              ": block_output must be [T, H] = [", num_tokens, ", ", p.width, "], got shape ",
              block_output.sizes());
  TORCH_CHECK(!injection_logits || (injection_logits->size(0) == num_tokens &&
                                    injection_logits->size(1) == hc_count),
              op, ": injection_logits must be [T, hc_count] = [", num_tokens, ", ", hc_count,
              "], got shape ", injection_logits ? injection_logits->sizes() : at::IntArrayRef{});
  if (norm_weight != nullptr) {
    p.weight_shared = check_norm_weight(op, "norm_weight", *norm_weight, residual, p.width,
                                        hc_count, &p.weight_dtype);
    p.eps = check_eps(op, eps);
    p.norm_weight = norm_weight->data_ptr();
  }
  p.residual = residual.data_ptr();
  p.block_output = block_output.data_ptr();
  p.injection_logits = injection_logits ? injection_logits->data_ptr() : nullptr;
  p.residual_row_stride = residual.stride(0);
  p.block_row_stride = block_output.stride(0);
  p.logits_row_stride = injection_logits ? injection_logits->stride(0) : 0;
  p.num_tokens = num_tokens;
  return p;
}

// The outputs: new [T, HC·H] contiguous tensors in residual's dtype (xn only with a norm), or the
// caller's.
// Binds the fresh, contiguous outputs h and xn (nullptr: the combine alone) the entry allocated.
inline void bind_fresh_hc_combine_outputs(const at::Tensor& residual, const at::Tensor& h,
                                          const at::Tensor* xn, HcCombineParams& p) {
  p.h = h.data_ptr();
  p.h_row_stride = residual.size(1);
  p.xn = xn != nullptr ? xn->data_ptr() : nullptr;
  p.xn_row_stride = residual.size(1);
}

inline void check_hc_combine_outputs(const char* op, const at::Tensor& residual,
                                     const at::Tensor& h, const at::Tensor* xn,
                                     HcCombineParams& p) {
  const char* h_name = xn != nullptr ? "h" : "out";
  hc_args::check_output(op, h_name, h, residual.sizes(), residual);
  p.h = h.data_ptr();
  p.h_row_stride = h.stride(0);
  if (xn != nullptr) {
    hc_args::check_output(op, "xn", *xn, residual.sizes(), residual);
    TORCH_CHECK(residual.numel() == 0 || xn->data_ptr() != h.data_ptr(), op,
                ": h and xn must be different tensors");
    p.xn = xn->data_ptr();
    p.xn_row_stride = xn->stride(0);
  }
}

// x [rows, num_groups·G], weight [G] or [num_groups·G]. Everything but the output.
inline HcRmsNormParams check_hc_rmsnorm_args(const at::Tensor& x, const at::Tensor& weight,
                                             double eps, int64_t num_groups) {
  using namespace hc_args;
  constexpr const char* op = "grouped_gemma_rmsnorm";
  HcRmsNormParams p{};
  p.dtype = activation_dtype(op, "x", x);
  check_rows_like(op, {"x", &x}, {});
  p.groups = check_hc_count(op, "num_groups", num_groups);
  p.width = part_width(op, "x's last dim", x.size(1), num_groups, "num_groups");
  p.weight_shared =
      check_norm_weight(op, "weight", weight, x, p.width, num_groups, &p.weight_dtype);
  p.eps = check_eps(op, eps);
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.x_row_stride = x.stride(0);
  p.num_rows = x.size(0);
  return p;
}

inline void set_hc_rmsnorm_output(const at::Tensor& x, const at::Tensor& out, HcRmsNormParams& p,
                                  bool caller_provided) {
  if (caller_provided) hc_args::check_output("grouped_gemma_rmsnorm", "out", out, x.sizes(), x);
  p.y = out.data_ptr();
  p.y_row_stride = out.stride(0);
}

}  // namespace qwen4exp
