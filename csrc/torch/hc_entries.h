// The torch entry points of the hyper-connection ops (issue #50; schemas in schemas.h), written
// once for every backend: check (args/hc_norm_args.h, hc_mix_args.h, hc_fused_args.h), allocate or
// check the outputs, run. `Backend` says where they run:
//   static void check_device(const char* op, const at::Tensor& t);   the tensors are its own
//   static at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& like);  a fresh output
//   static void run(const char* op, const P& params, const at::Tensor& like);  for each params
// csrc/torch/cpu_ops.cpp instantiates it with the CPU kernels, csrc/torch/gpu/hc_gpu.cpp with the
// HIP launchers (on a GPU, or on the SIMT emulator).
#pragma once

#include <torch/library.h>

#include <tuple>

#include "args/hc_fused_args.h"
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

  static at::Tensor up_gate_mix(const at::Tensor& lowrank, const at::Tensor& w_up,
                                const at::Tensor& xn, int64_t hc_count) {
    constexpr const char* op = "hc_up_gate_mix";
    HcUpGateMixParams p = check_hc_up_gate_mix_args(lowrank, w_up, xn, hc_count);
    Backend::check_device(op, lowrank);
    at::Tensor out = Backend::empty({lowrank.size(0), p.width}, lowrank);
    p.out = out.data_ptr();
    p.out_row_stride = p.width;
    Backend::run(op, p, lowrank);
    return out;
  }

  static void up_gate_mix_out(const at::Tensor& lowrank, const at::Tensor& w_up,
                              const at::Tensor& xn, int64_t hc_count, const at::Tensor& out) {
    constexpr const char* op = "hc_up_gate_mix";
    HcUpGateMixParams p = check_hc_up_gate_mix_args(lowrank, w_up, xn, hc_count);
    Backend::check_device(op, lowrank);
    hc_args::check_output(op, "out", out, {lowrank.size(0), p.width}, lowrank);
    p.out = out.data_ptr();
    p.out_row_stride = out.stride(0);
    Backend::run(op, p, lowrank);
  }

  // Without w_inj the logits are [T, 0] (the Python door returns None for them).
  static std::tuple<at::Tensor, at::Tensor> down_silu_inject(const at::Tensor& xn,
                                                             const at::Tensor& w_down,
                                                             const std::optional<at::Tensor>& w_inj,
                                                             int64_t hc_count) {
    constexpr const char* op = "hc_down_silu_inject";
    HcDownSiluInjectParams p = check_hc_down_silu_inject_args(xn, w_down, w_inj, hc_count);
    Backend::check_device(op, xn);
    at::Tensor lowrank = Backend::empty({xn.size(0), p.rank}, xn);
    at::Tensor logits = Backend::empty({xn.size(0), w_inj.has_value() ? hc_count : 0}, xn);
    p.lowrank = lowrank.data_ptr();
    p.lowrank_row_stride = p.rank;
    if (w_inj.has_value()) {
      p.logits = logits.data_ptr();
      p.logits_row_stride = hc_count;
    }
    Backend::run(op, p, xn);
    return {lowrank, logits};
  }

  static void down_silu_inject_out(const at::Tensor& xn, const at::Tensor& w_down,
                                   const std::optional<at::Tensor>& w_inj, int64_t hc_count,
                                   const at::Tensor& lowrank,
                                   const std::optional<at::Tensor>& logits) {
    constexpr const char* op = "hc_down_silu_inject";
    HcDownSiluInjectParams p = check_hc_down_silu_inject_args(xn, w_down, w_inj, hc_count);
    Backend::check_device(op, xn);
    TORCH_CHECK(logits.has_value() == w_inj.has_value(), op,
                ": logits must be given exactly when w_inj is");
    hc_args::check_output(op, "lowrank", lowrank, {xn.size(0), p.rank}, xn);
    p.lowrank = lowrank.data_ptr();
    p.lowrank_row_stride = lowrank.stride(0);
    if (logits.has_value()) {
      hc_args::check_output(op, "logits", *logits, {xn.size(0), hc_count}, xn);
      p.logits = logits->data_ptr();
      p.logits_row_stride = logits->stride(0);
    }
    Backend::run(op, p, xn);
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
    m.impl("hc_up_gate_mix", &up_gate_mix);
    m.impl("hc_up_gate_mix_out", &up_gate_mix_out);
    m.impl("hc_down_silu_inject", &down_silu_inject);
    m.impl("hc_down_silu_inject_out", &down_silu_inject_out);
  }
};

}  // namespace qwen4exp
