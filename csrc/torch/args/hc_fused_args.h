// Argument checks and params for the fused hyper-connection projections, hc_up_gate_mix and
// hc_down_silu_inject (csrc/common/hc_fused.h), shared by the CPU and GPU entry points so that
// both reject the same inputs with the same messages. The weights are the activations' dtype (as
// vLLM's GEMMs take them) and row-major views (unit stride along K, any row stride: views of a
// merged down+inject weight are fine).
#pragma once

#include "../../common/hc_fused.h"
#include "hc_args.h"

namespace qwen4exp {

// lowrank [T, R], w_up [HC·H, R], xn [T, HC·H]. Everything but the output ([T, H]).
inline HcUpGateMixParams check_hc_up_gate_mix_args(const at::Tensor& lowrank,
                                                   const at::Tensor& w_up, const at::Tensor& xn,
                                                   int64_t hc_count) {
  using namespace hc_args;
  constexpr const char* op = "hc_up_gate_mix";
  HcUpGateMixParams p{};
  p.dtype = activation_dtype(op, "lowrank", lowrank);
  check_rows_like(op, {"lowrank", &lowrank}, {{"w_up", &w_up}, {"xn", &xn}});
  p.streams = check_hc_count(op, "hc_count", hc_count);
  p.width = part_width(op, "xn's last dim HC·H", xn.size(1), hc_count, "hc_count");
  TORCH_CHECK(xn.size(0) == lowrank.size(0), op, ": xn must have lowrank's ", lowrank.size(0),
              " rows (tokens), got ", xn.size(0));
  TORCH_CHECK(lowrank.size(1) > 0 && lowrank.size(1) <= kMaxWidth, op,
              ": lowrank's last dim R must be in [1, 2^24], got ", lowrank.size(1));
  TORCH_CHECK(w_up.size(0) == xn.size(1) && w_up.size(1) == lowrank.size(1), op,
              ": w_up must be [HC·H, R] = [", xn.size(1), ", ", lowrank.size(1), "], got ",
              w_up.sizes());
  p.lowrank = lowrank.data_ptr();
  p.w_up = w_up.data_ptr();
  p.xn = xn.data_ptr();
  p.lowrank_row_stride = lowrank.stride(0);
  p.w_row_stride = w_up.stride(0);
  p.xn_row_stride = xn.stride(0);
  p.num_tokens = lowrank.size(0);
  p.rank = static_cast<int32_t>(lowrank.size(1));
  return p;
}

// xn [T, K = HC·H], w_down [R, K], w_inj [HC, K] or None. Everything but the outputs ([T, R],
// [T, HC]) and the workspace.
inline HcDownSiluInjectParams check_hc_down_silu_inject_args(const at::Tensor& xn,
                                                             const at::Tensor& w_down,
                                                             const std::optional<at::Tensor>& w_inj,
                                                             int64_t hc_count) {
  using namespace hc_args;
  constexpr const char* op = "hc_down_silu_inject";
  HcDownSiluInjectParams p{};
  p.dtype = activation_dtype(op, "xn", xn);
  if (w_inj.has_value()) {
    check_rows_like(op, {"xn", &xn}, {{"w_down", &w_down}, {"w_inj", &*w_inj}});
  } else {
    check_rows_like(op, {"xn", &xn}, {{"w_down", &w_down}});
  }
  p.streams = check_hc_count(op, "hc_count", hc_count);
  part_width(op, "xn's last dim HC·H", xn.size(1), hc_count, "hc_count");
  TORCH_CHECK(xn.size(1) <= kMaxWidth, op, ": xn's last dim ", xn.size(1),
              " is more than the supported 2^24");
  TORCH_CHECK(w_down.size(1) == xn.size(1) && w_down.size(0) > 0 && w_down.size(0) <= kMaxWidth, op,
              ": w_down must be [R, HC·H] with HC·H = ", xn.size(1), " and R in [1, 2^24], got ",
              w_down.sizes());
  if (w_inj.has_value()) {
    TORCH_CHECK(w_inj->size(0) == hc_count && w_inj->size(1) == xn.size(1), op,
                ": w_inj must be [hc_count, HC·H] = [", hc_count, ", ", xn.size(1), "], got ",
                w_inj->sizes());
    p.w_inj = w_inj->data_ptr();
    p.w_inj_row_stride = w_inj->stride(0);
  }
  p.xn = xn.data_ptr();
  p.w_down = w_down.data_ptr();
  p.xn_row_stride = xn.stride(0);
  p.w_down_row_stride = w_down.stride(0);
  p.num_tokens = xn.size(0);
  p.depth = static_cast<int32_t>(xn.size(1));
  p.rank = static_cast<int32_t>(w_down.size(0));
  return p;
}

}  // namespace qwen4exp
