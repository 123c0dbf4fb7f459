// Argument checks and params for ple_conv, shared by the CPU and GPU host entry points so both
// reject the same inputs with the same messages. Checks here look only at metadata (dtype, rank,
// shape, strides, device); the CPU entry point additionally validates the index values it can
// read for free, and the GPU kernels skip rows whose indices are out of range.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "../../common/ple_conv.h"
#include "tensor_args.h"

namespace qwen4exp {

inline ConvMode parse_conv_mode(const std::string& mode) {
  if (mode == "decode") return ConvMode::kDecode;
  if (mode == "prefill") return ConvMode::kPrefill;
  if (mode == "spec") return ConvMode::kSpec;
  TORCH_CHECK(false, "ple_conv: mode must be 'decode', 'prefill' or 'spec', got '", mode, "'");
}

// A 1-D index vector (or a [n, 1] column view, as a block-table column) with at least `min_len`
// entries, of one of the given kinds.
inline IndexView conv_index_view(const at::Tensor& t, const char* name, int64_t min_len,
                                 bool allow_bool, const at::Device& device) {
  const auto dtype = t.scalar_type();
  const bool ok_dtype = dtype == at::kInt || dtype == at::kLong ||
                        (allow_bool && (dtype == at::kBool || dtype == at::kByte));
  TORCH_CHECK(ok_dtype, "ple_conv: ", name, " must be int32 or int64",
              allow_bool ? " (or bool)" : "", ", got ", dtype);
  TORCH_CHECK(t.dim() == 1 || (t.dim() == 2 && t.size(1) == 1), "ple_conv: ", name,
              " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.size(0) >= min_len, "ple_conv: ", name, " needs at least ", min_len,
              " entries, got ", t.size(0));
  TORCH_CHECK(t.device() == device, "ple_conv: ", name, " is on ", t.device(), " but inputs is on ",
              device);
  return index_view(t);
}

inline void check_conv_rows(const at::Tensor& t, const char* name, const at::Tensor& inputs) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == inputs.sizes(), "ple_conv: ", name,
              " must have inputs' shape ", inputs.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == inputs.scalar_type(), "ple_conv: ", name,
              " must have inputs' dtype ", inputs.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "ple_conv: ", name,
              " must have unit stride along channels, got strides ", t.strides());
  TORCH_CHECK(t.device() == inputs.device(), "ple_conv: ", name, " is on ", t.device(),
              " but inputs is on ", inputs.device());
}

inline PleConvParams check_ple_conv_args(
    const at::Tensor& inputs, const at::Tensor& residual, const at::Tensor& conv_state,
    const at::Tensor& conv_weights, const at::Tensor& state_indices,
    const std::optional<at::Tensor>& outer_residual, const std::string& mode_name, int64_t dilation,
    const std::optional<at::Tensor>& query_start_loc,
    const std::optional<at::Tensor>& num_accepted_tokens,
    const std::optional<at::Tensor>& has_initial_states, int64_t spec_query_len,
    const std::optional<at::Tensor>& token_indices) {
  PleConvParams p{};
  p.mode = parse_conv_mode(mode_name);
  const auto device = inputs.device();
  TORCH_CHECK(inputs.dim() == 2, "ple_conv: inputs must be 2-D [T, C], got shape ", inputs.sizes());
  TORCH_CHECK(float_dtype_of(inputs.scalar_type(), &p.dtype),
              "ple_conv: inputs must be float32, bfloat16 or float16, got ", inputs.scalar_type());
  TORCH_CHECK(inputs.size(1) <= 1 || inputs.stride(1) == 1,
              "ple_conv: inputs must have unit stride along channels, got strides ",
              inputs.strides());
  const int64_t channels = inputs.size(1);
  check_conv_rows(residual, "residual", inputs);
  if (outer_residual.has_value()) check_conv_rows(*outer_residual, "outer_residual", inputs);

  TORCH_CHECK(conv_weights.dim() == 2 && conv_weights.size(0) == channels,
              "ple_conv: conv_weights must be [C, K] = [", channels, ", K], got shape ",
              conv_weights.sizes());
  const int64_t kernel_size = conv_weights.size(1);
  TORCH_CHECK(kernel_size >= 1 && kernel_size <= kMaxConvKernel,
              "ple_conv: conv_weights' kernel size K must be in [1, ", kMaxConvKernel, "], got ",
              kernel_size);
  TORCH_CHECK(float_dtype_of(conv_weights.scalar_type(), &p.weight_dtype) &&
                  (conv_weights.scalar_type() == at::kFloat ||
                   conv_weights.scalar_type() == inputs.scalar_type()),
              "ple_conv: conv_weights must be float32 or inputs' dtype ", inputs.scalar_type(),
              ", got ", conv_weights.scalar_type());
  TORCH_CHECK(conv_weights.device() == device, "ple_conv: conv_weights is on ",
              conv_weights.device(), " but inputs is on ", device);
  TORCH_CHECK(dilation >= 1 && dilation <= kMaxConvDilation, "ple_conv: dilation must be in [1, ",
              kMaxConvDilation, "], got ", dilation);
  const int64_t state_len = (kernel_size - 1) * dilation;
  const bool spec = p.mode == ConvMode::kSpec;
  TORCH_CHECK(!spec || (spec_query_len >= 1 && spec_query_len <= 4096),
              "ple_conv: spec_query_len must be in [1, 4096], got ", spec_query_len);
  const int64_t query_len = spec ? spec_query_len : 1;
  const int64_t state_width = state_len + query_len - 1;

  TORCH_CHECK(
      conv_state.dim() == 3 && conv_state.size(1) == channels && conv_state.size(2) >= state_width,
      "ple_conv: conv_state must have shape [slots, channels, window], with channels=", channels,
      " and window >= ", state_width, ", got ", conv_state.sizes());
  TORCH_CHECK(conv_state.scalar_type() == inputs.scalar_type(),
              "ple_conv: conv_state must have inputs' dtype ", inputs.scalar_type(), ", got ",
              conv_state.scalar_type());
  TORCH_CHECK(conv_state.device() == device, "ple_conv: conv_state is on ", conv_state.device(),
              " but inputs is on ", device);
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(conv_state.stride(d) >= 0, "ple_conv: conv_state must have non-negative strides");
  }

  const bool has_map = token_indices.has_value();
  const int64_t num_rows = has_map ? token_indices->numel() : inputs.size(0);
  if (has_map) {
    p.token_indices = conv_index_view(*token_indices, "token_indices", num_rows, false, device);
  }
  if (p.mode == ConvMode::kDecode) {
    p.num_requests = num_rows;
    p.state_indices = conv_index_view(state_indices, "state_indices", num_rows, false, device);
    if (has_initial_states.has_value()) {
      p.has_initial_states =
          conv_index_view(*has_initial_states, "has_initial_states", num_rows, true, device);
    }
  } else {
    TORCH_CHECK(query_start_loc.has_value() &&
                    (spec ? num_accepted_tokens.has_value() : has_initial_states.has_value()),
                spec ? "ple_conv: query_start_loc and num_accepted_tokens are required for spec "
                       "decode"
                     : "ple_conv: query_start_loc and has_initial_states are required for prefill");
    p.state_indices = conv_index_view(state_indices, "state_indices", 0, false, device);
    p.num_requests = state_indices.size(0);
    p.query_start_loc =
        conv_index_view(*query_start_loc, "query_start_loc", p.num_requests + 1, false, device);
    if (spec) {
      p.num_accepted_tokens = conv_index_view(*num_accepted_tokens, "num_accepted_tokens",
                                              p.num_requests, false, device);
    } else {
      p.has_initial_states =
          conv_index_view(*has_initial_states, "has_initial_states", p.num_requests, true, device);
    }
  }

  p.inputs = inputs.data_ptr();
  p.residual = residual.data_ptr();
  p.outer_residual = outer_residual.has_value() ? outer_residual->data_ptr() : nullptr;
  p.inputs_row_stride = inputs.stride(0);
  p.residual_row_stride = residual.stride(0);
  p.outer_row_stride = outer_residual.has_value() ? outer_residual->stride(0) : 0;
  p.conv_state = conv_state.data_ptr();
  p.state_slot_stride = conv_state.stride(0);
  p.state_channel_stride = conv_state.stride(1);
  p.state_window_stride = conv_state.stride(2);
  p.num_slots = conv_state.size(0);
  p.state_width = conv_state.size(2);
  p.weights = conv_weights.data_ptr();
  p.weight_channel_stride = conv_weights.stride(0);
  p.weight_tap_stride = conv_weights.stride(1);
  p.num_rows = num_rows;
  p.num_physical_rows = inputs.size(0);
  p.channels = channels;
  p.kernel_size = static_cast<int32_t>(kernel_size);
  p.dilation = static_cast<int32_t>(dilation);
  p.state_len = static_cast<int32_t>(state_len);
  p.query_len = static_cast<int32_t>(query_len);
  return p;
}

// Value checks (token_indices, state_indices, query_start_loc) that need the index data on the
// host: always on the CPU path, which reads it for free and so rejects what the GPU kernels can
// only skip; on the GPU path only as opt-in debug checks (csrc/torch/gpu/debug_checks.h).
inline void check_ple_conv_values(const PleConvParams& p) {
  if (p.token_indices.present()) {
    for (int64_t t = 0; t < p.num_rows; ++t) {
      const int64_t row = p.token_indices[t];
      TORCH_CHECK(row >= 0 && row < p.num_physical_rows, "ple_conv: token_indices[", t, "] = ", row,
                  " is outside the ", p.num_physical_rows, " rows of inputs");
    }
  }
  std::vector<bool> used(p.num_slots, false);
  for (int64_t r = 0; r < p.num_requests; ++r) {
    const int64_t slot = p.state_indices[r];
    TORCH_CHECK(slot >= 0 && slot < p.num_slots, "ple_conv: state_indices[", r, "] = ", slot,
                " is outside conv_state's ", p.num_slots, " slots");
    if (slot == kNullSlot) continue;
    TORCH_CHECK(!used[slot], "ple_conv: state_indices holds slot ", slot,
                " twice; every live request needs its own slot");
    used[slot] = true;
  }
  if (p.mode == ConvMode::kDecode) return;
  const IndexView& qsl = p.query_start_loc;
  TORCH_CHECK(qsl[0] == 0, "ple_conv: query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t r = 0; r < p.num_requests; ++r) {
    TORCH_CHECK(qsl[r + 1] >= qsl[r], "ple_conv: query_start_loc must be non-decreasing, got ",
                qsl[r], " then ", qsl[r + 1], " at index ", r);
    if (p.mode == ConvMode::kSpec) {
      TORCH_CHECK(qsl[r + 1] - qsl[r] <= p.query_len, "ple_conv: spec request ", r, " has ",
                  qsl[r + 1] - qsl[r], " tokens, more than spec_query_len = ", p.query_len);
    }
  }
  TORCH_CHECK(qsl[p.num_requests] <= p.num_rows,
              "ple_conv: query_start_loc[R] = ", qsl[p.num_requests], " is past the ", p.num_rows,
              " tokens");
}

}  // namespace qwen4exp
