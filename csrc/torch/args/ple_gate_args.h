// Argument checks and params for ple_gate, shared by the CPU and GPU host entry points so both
// reject the same inputs with the same messages (metadata only: dtype, rank, shape, strides,
// device).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <string>

#include "../../common/ple_gate.h"
#include "tensor_args.h"

namespace qwen4exp {

inline GateRounding parse_gate_rounding(const std::string& rounding) {
  TORCH_CHECK(rounding == "vllm" || rounding == "fp32",
              "ple_gate: rounding must be 'vllm' or 'fp32', got '", rounding, "'");
  return rounding == "vllm" ? GateRounding::kVllm : GateRounding::kFp32;
}

// Checks everything but the outputs, which the entry point allocates from the returned shape.
inline PleGateParams check_ple_gate_args(const at::Tensor& key, const at::Tensor& value,
                                         const at::Tensor& hidden, const at::Tensor& norm_key_w,
                                         const at::Tensor& norm_query_w,
                                         const at::Tensor& norm_conv_w, double eps,
                                         const std::string& rounding) {
  PleGateParams p{};
  p.rounding = parse_gate_rounding(rounding);
  TORCH_CHECK(hidden.dim() == 2, "ple_gate: hidden must be 2-D [T, C], got shape ", hidden.sizes());
  TORCH_CHECK(float_dtype_of(hidden.scalar_type(), &p.dtype),
              "ple_gate: hidden must be float32, bfloat16 or float16, got ", hidden.scalar_type());
  TORCH_CHECK(key.scalar_type() == hidden.scalar_type(), "ple_gate: key must have hidden's dtype ",
              hidden.scalar_type(), ", got ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == hidden.scalar_type(),
              "ple_gate: value must have hidden's dtype ", hidden.scalar_type(), ", got ",
              value.scalar_type());
  const int64_t num_tokens = hidden.size(0);
  const int64_t channels = hidden.size(1);
  TORCH_CHECK(value.dim() == 2 && value.size(0) == num_tokens && value.size(1) >= 1,
              "ple_gate: value must be [T, H] = [", num_tokens, ", H], got shape ", value.sizes());
  const int64_t width = value.size(1);
  TORCH_CHECK(channels % width == 0 && channels >= width, "ple_gate: hidden's C = ", channels,
              " must be a positive multiple of value's H = ", width);
  TORCH_CHECK(width <= (int64_t{1} << 24), "ple_gate: H = ", width,
              " is more than the supported 2^24");
  // The params hold M (as H) in 32 bits: more streams would wrap, and the kernels would compute
  // the wrapped count's streams (none, for a negative one) and leave the rest unwritten.
  TORCH_CHECK(channels / width <= std::numeric_limits<int32_t>::max(),
              "ple_gate: C / H = ", channels / width,
              " streams is more than the supported 2^31 - 1 (C = ", channels, ", H = ", width, ")");
  TORCH_CHECK(key.dim() == 2 && key.size(0) == num_tokens && key.size(1) == channels,
              "ple_gate: key must be [T, C] = [", num_tokens, ", ", channels, "], got shape ",
              key.sizes());
  const std::pair<const char*, const at::Tensor*> rows[] = {
      {"key", &key}, {"value", &value}, {"hidden", &hidden}};
  for (const auto& [name, tensor] : rows) {
    TORCH_CHECK(tensor->size(1) <= 1 || tensor->stride(1) == 1, "ple_gate: ", name,
                " must have unit stride along its last dim (a row-major view), got strides ",
                tensor->strides());
    TORCH_CHECK(tensor->stride(0) >= 0, "ple_gate: ", name, " must have a non-negative row stride");
  }
  const at::Tensor* weights[] = {&norm_key_w, &norm_query_w, &norm_conv_w};
  const char* weight_names[] = {"norm_key_w", "norm_query_w", "norm_conv_w"};
  TORCH_CHECK(float_dtype_of(norm_key_w.scalar_type(), &p.weight_dtype) &&
                  (norm_key_w.scalar_type() == at::kFloat ||
                   norm_key_w.scalar_type() == hidden.scalar_type()),
              "ple_gate: norm_key_w must be float32 or hidden's dtype ", hidden.scalar_type(),
              ", got ", norm_key_w.scalar_type());
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& w = *weights[i];
    TORCH_CHECK(w.scalar_type() == norm_key_w.scalar_type(), "ple_gate: ", weight_names[i],
                " must have norm_key_w's dtype ", norm_key_w.scalar_type(), ", got ",
                w.scalar_type());
    TORCH_CHECK(w.dim() == 1 && w.size(0) == channels, "ple_gate: ", weight_names[i],
                " must be [C] = [", channels, "], got shape ", w.sizes());
    TORCH_CHECK(w.is_contiguous(), "ple_gate: ", weight_names[i], " must be contiguous");
  }
  const auto device = hidden.device();
  const std::pair<const char*, const at::Tensor*> others[] = {{"key", &key},
                                                              {"value", &value},
                                                              {"norm_key_w", &norm_key_w},
                                                              {"norm_query_w", &norm_query_w},
                                                              {"norm_conv_w", &norm_conv_w}};
  for (const auto& [name, tensor] : others) {
    TORCH_CHECK(tensor->device() == device, "ple_gate: ", name, " is on ", tensor->device(),
                " but hidden is on ", device);
  }
  // eps is what keeps an all-zero row finite (rsqrt(0 + eps)); it reaches the kernel as fp32, so a
  // value that rounds to 0 there (or is inf/NaN) would give inf/NaN rows instead of an error.
  TORCH_CHECK(std::isfinite(eps) && eps > 0.0 && std::isfinite(static_cast<float>(eps)) &&
                  static_cast<float>(eps) > 0.0f,
              "ple_gate: eps must be a positive finite number (also in fp32), got ", eps);

  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.hidden = hidden.data_ptr();
  p.key_row_stride = key.stride(0);
  p.value_row_stride = value.stride(0);
  p.hidden_row_stride = hidden.stride(0);
  p.norm_key_w = norm_key_w.data_ptr();
  p.norm_query_w = norm_query_w.data_ptr();
  p.norm_conv_w = norm_conv_w.data_ptr();
  p.num_tokens = num_tokens;
  p.width = static_cast<int32_t>(width);
  p.streams = static_cast<int32_t>(channels / width);
  p.eps = static_cast<float>(eps);  // vLLM hands eps to its kernel as an fp32 argument
  return p;
}

// The two outputs, [T, C] contiguous in hidden's dtype, wired into the params.
inline std::tuple<at::Tensor, at::Tensor> allocate_ple_gate_outputs(const at::Tensor& hidden,
                                                                    PleGateParams& p) {
  at::Tensor gated = at::empty(hidden.sizes(), hidden.options());
  at::Tensor conv_input = at::empty(hidden.sizes(), hidden.options());
  p.gated = gated.data_ptr();
  p.conv_input = conv_input.data_ptr();
  p.gated_row_stride = hidden.size(1);
  p.conv_input_row_stride = hidden.size(1);
  return {gated, conv_input};
}

// Caller-provided outputs (ple_gate_out): [T, C] row-major views in hidden's dtype.
inline void check_ple_gate_outputs(const at::Tensor& hidden, const at::Tensor& gated,
                                   const at::Tensor& conv_input, PleGateParams& p) {
  const std::pair<const char*, const at::Tensor*> outputs[] = {{"gated", &gated},
                                                               {"conv_input", &conv_input}};
  for (const auto& [name, tensor] : outputs) {
    TORCH_CHECK(tensor->dim() == 2 && tensor->sizes() == hidden.sizes(), "ple_gate: ", name,
                " must be [T, C] = ", hidden.sizes(), ", got ", tensor->sizes());
    TORCH_CHECK(tensor->scalar_type() == hidden.scalar_type(), "ple_gate: ", name,
                " must have hidden's dtype ", hidden.scalar_type(), ", got ",
                tensor->scalar_type());
    TORCH_CHECK(tensor->size(1) <= 1 || tensor->stride(1) == 1, "ple_gate: ", name,
                " must have unit stride along its last dim, got strides ", tensor->strides());
    TORCH_CHECK(tensor->device() == hidden.device(), "ple_gate: ", name, " is on ",
                tensor->device(), " but hidden is on ", hidden.device());
  }
  p.gated = gated.data_ptr();
  p.conv_input = conv_input.data_ptr();
  p.gated_row_stride = gated.stride(0);
  p.conv_input_row_stride = conv_input.stride(0);
}

}  // namespace qwen4exp
