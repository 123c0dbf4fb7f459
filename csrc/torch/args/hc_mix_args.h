// Argument checks and params for hc_gate_mix and hc_silu (csrc/common/hc_mix.h), shared by the
// CPU and GPU entry points so that both reject the same inputs with the same messages.
#pragma once

#include "../../common/hc_mix.h"
#include "hc_args.h"

namespace qwen4exp {

// x and gate [T, HC·H]. Everything but the output ([T, H]).
inline HcGateMixParams check_hc_gate_mix_args(const at::Tensor& x, const at::Tensor& gate,
                                              int64_t hc_count) {
  using namespace hc_args;
  constexpr const char* op = "hc_gate_mix";
  HcGateMixParams p{};
  p.dtype = activation_dtype(op, "x", x);
  check_rows_like(op, {"x", &x}, {{"gate", &gate}});
  TORCH_CHECK(gate.sizes() == x.sizes(), op, ": gate must have x's shape ", x.sizes(), ", got ",
              gate.sizes());
  p.streams = check_hc_count(op, "hc_count", hc_count);
  p.width = part_width(op, "x's last dim HC·H", x.size(1), hc_count, "hc_count");
  p.x = x.data_ptr();
  p.gate = gate.data_ptr();
  p.x_row_stride = x.stride(0);
  p.gate_row_stride = gate.stride(0);
  p.num_tokens = x.size(0);
  return p;
}

// x [T, D]. Everything but the output ([T, D]).
inline HcSiluParams check_hc_silu_args(const at::Tensor& x, int64_t hc_count) {
  using namespace hc_args;
  constexpr const char* op = "hc_silu";
  HcSiluParams p{};
  p.dtype = activation_dtype(op, "x", x);
  check_rows_like(op, {"x", &x}, {});
  p.hc_count = check_hc_count(op, "hc_count", hc_count);
  TORCH_CHECK(x.size(1) <= kMaxWidth, op, ": x's last dim ", x.size(1),
              " is more than the supported 2^24");
  p.width = static_cast<int32_t>(x.size(1));
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  p.num_tokens = x.size(0);
  return p;
}

}  // namespace qwen4exp
