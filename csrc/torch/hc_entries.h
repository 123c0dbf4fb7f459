// The torch entry points of the hyper-connection ops (issue #50; schemas in schemas.h), written
// once for every backend: check (args/hc_norm_args.h, args/hc_mix_args.h), allocate or check
// the outputs, run. `Backend` says where they run:
//   static void check_device(const char* op, const at::Tensor& t);   the tensors are its own
//   static at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& like);  a fresh output
//   static void run(const char* op, const P& params, const at::Tensor& like);  for each params
// csrc/torch/cpu_ops.cpp instantiates it with the CPU kernels, csrc/torch/gpu/hc_gpu.cpp with the
// HIP launchers (on a GPU, or on the SIMT emulator).
#pragma once

#include <torch/library.h>

#include <tuple>

#include "args/hc_mix_args.h"
#include "args/hc_norm_args.h"

namespace qwen4exp {

template <typename Backend>
struct HcEntries {
  static std::tuple<at::Tensor, at::Tensor> combine_norm(
      const at::Tensor& residual, const at::Tensor& block_output,
      const std::optional<at::Tensor>& injection_logits, const at::Tensor& norm_weight, double eps,
      int64_t hc_count) {
    constexpr const char* op = "hc_combine_norm";
    HcCombineParams p = check_hc_combine_args(op, residual, block_output, injection_logits,
                                              &norm_weight, eps, hc_count);
    Backend::check_device(op, residual);
    at::Tensor h = Backend::empty(residual.sizes(), residual);
    at::Tensor xn = Backend::empty(residual.sizes(), residual);
    bind_fresh_hc_combine_outputs(residual, h, &xn, p);
    Backend::run(op, p, residual);
    return {h, xn};
  }

  static void combine_norm_out(const at::Tensor& residual, const at::Tensor& block_output,
                               const std::optional<at::Tensor>& injection_logits,
                               const at::Tensor& norm_weight, double eps, int64_t hc_count,
                               const at::Tensor& h, const at::Tensor& xn) {
    constexpr const char* op = "hc_combine_norm";
    HcCombineParams p = check_hc_combine_args(op, residual, block_output, injection_logits,
                                              &norm_weight, eps, hc_count);
    Backend::check_device(op, residual);
    check_hc_combine_outputs(op, residual, h, &xn, p);
    Backend::run(op, p, residual);
  }

  static at::Tensor combine(const at::Tensor& residual, const at::Tensor& block_output,
                            const std::optional<at::Tensor>& injection_logits, int64_t hc_count) {
    constexpr const char* op = "hc_combine";
    HcCombineParams p = check_hc_combine_args(op, residual, block_output, injection_logits, nullptr,
                                              1e-6, hc_count);
    Backend::check_device(op, residual);
    at::Tensor h = Backend::empty(residual.sizes(), residual);
    bind_fresh_hc_combine_outputs(residual, h, nullptr, p);
    Backend::run(op, p, residual);
    return h;
  }

  static void combine_out(const at::Tensor& residual, const at::Tensor& block_output,
                          const std::optional<at::Tensor>& injection_logits, int64_t hc_count,
                          const at::Tensor& out) {
    constexpr const char* op = "hc_combine";
    HcCombineParams p = check_hc_combine_args(op, residual, block_output, injection_logits, nullptr,
                                              1e-6, hc_count);
    Backend::check_device(op, residual);
    check_hc_combine_outputs(op, residual, out, nullptr, p);
    Backend::run(op, p, residual);
  }

  static at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                            int64_t num_groups) {
    HcRmsNormParams p = check_hc_rmsnorm_args(x, weight, eps, num_groups);
    Backend::check_device("grouped_gemma_rmsnorm", x);
    at::Tensor out = Backend::empty(x.sizes(), x);
    set_hc_rmsnorm_output(x, out, p, false);
    Backend::run("grouped_gemma_rmsnorm", p, x);
    return out;
  }

  static void rmsnorm_out(const at::Tensor& x, const at::Tensor& weight, double eps,
                          int64_t num_groups, const at::Tensor& out) {
    HcRmsNormParams p = check_hc_rmsnorm_args(x, weight, eps, num_groups);
    Backend::check_device("grouped_gemma_rmsnorm", x);
    set_hc_rmsnorm_output(x, out, p, true);
    Backend::run("grouped_gemma_rmsnorm", p, x);
  }

  static at::Tensor gate_mix(const at::Tensor& x, const at::Tensor& gate, int64_t hc_count) {
    HcGateMixParams p = check_hc_gate_mix_args(x, gate, hc_count);
    Backend::check_device("hc_gate_mix", x);
    at::Tensor out = Backend::empty({x.size(0), p.width}, x);
    p.out = out.data_ptr();
    p.out_row_stride = p.width;
    Backend::run("hc_gate_mix", p, x);
    return out;
  }

  static void gate_mix_out(const at::Tensor& x, const at::Tensor& gate, int64_t hc_count,
                           const at::Tensor& out) {
    HcGateMixParams p = check_hc_gate_mix_args(x, gate, hc_count);
    Backend::check_device("hc_gate_mix", x);
    hc_args::check_output("hc_gate_mix", "out", out, {x.size(0), p.width}, x);
    p.out = out.data_ptr();
    p.out_row_stride = out.stride(0);
    Backend::run("hc_gate_mix", p, x);
  }

  static at::Tensor silu(const at::Tensor& x, int64_t hc_count) {
    HcSiluParams p = check_hc_silu_args(x, hc_count);
    Backend::check_device("hc_silu", x);
    at::Tensor out = Backend::empty(x.sizes(), x);
    p.y = out.data_ptr();
    p.y_row_stride = x.size(1);
    Backend::run("hc_silu", p, x);
    return out;
  }

  static void silu_out(const at::Tensor& x, int64_t hc_count, const at::Tensor& out) {
    HcSiluParams p = check_hc_silu_args(x, hc_count);
    Backend::check_device("hc_silu", x);
    hc_args::check_output("hc_silu", "out", out, x.sizes(), x);
    p.y = out.data_ptr();
    p.y_row_stride = out.stride(0);
    Backend::run("hc_silu", p, x);
  }

  static void register_impls(torch::Library& m) {
    m.impl("hc_combine_norm", &combine_norm);
    m.impl("hc_combine_norm_out", &combine_norm_out);
    m.impl("hc_combine", &combine);
    m.impl("hc_combine_out", &combine_out);
    m.impl("grouped_gemma_rmsnorm", &rmsnorm);
    m.impl("grouped_gemma_rmsnorm_out", &rmsnorm_out);
    m.impl("hc_gate_mix", &gate_mix);
    m.impl("hc_gate_mix_out", &gate_mix_out);
    m.impl("hc_silu", &silu);
    m.impl("hc_silu_out", &silu_out);
  }
};

}  // namespace qwen4exp
