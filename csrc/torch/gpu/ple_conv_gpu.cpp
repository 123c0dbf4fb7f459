// Host glue for the HIP ple_conv kernels: checks -> params -> device guard -> current stream ->
// launch -> launch check. The index data stays on the device (reading it would sync the
// stream); the kernels skip rows whose indices are out of range (csrc/hip/ple_conv.hip).
#include "glue.h"

#include "debug_checks.h"
#include "../../common/ple_conv.h"
#include "../args/ple_conv_args.h"

namespace qwen4exp {
namespace {

void ple_conv_gpu(const at::Tensor& inputs, const at::Tensor& residual,
                  const at::Tensor& conv_state, const at::Tensor& conv_weights,
                  const at::Tensor& state_indices, const std::optional<at::Tensor>& outer_residual,
                  c10::string_view mode, int64_t dilation,
                  const std::optional<at::Tensor>& query_start_loc,
                  const std::optional<at::Tensor>& num_accepted_tokens,
                  const std::optional<at::Tensor>& has_initial_states, int64_t spec_query_len,
                  const std::optional<at::Tensor>& token_indices) {
  const PleConvParams p = check_ple_conv_args(inputs, residual, conv_state, conv_weights,
                                              state_indices, outer_residual, std::string(mode),
                                              dilation, query_start_loc, num_accepted_tokens,
                                              has_initial_states, spec_query_len, token_indices);
  TORCH_CHECK(glue::on_kernel_device(inputs), "ple_conv: GPU kernel called with ", inputs.device(),
              " tensors");
  if (debug_checks_enabled()) {
    PleConvParams host = p;
    HostIndexCopies copies;
    const auto to_host = [&copies](IndexView& view, const at::Tensor& t) {
      view.data = copies.add(t, &view.stride);
    };
    to_host(host.state_indices, state_indices);
    if (p.query_start_loc.present()) to_host(host.query_start_loc, *query_start_loc);
    if (p.token_indices.present()) to_host(host.token_indices, *token_indices);
    // num_accepted_tokens and has_initial_states are not read by the value checks.
    host.num_accepted_tokens.data = nullptr;
    host.has_initial_states.data = nullptr;
    check_ple_conv_values(host);
  }
  const bool writes_back = p.mode != ConvMode::kDecode && p.num_requests > 0;
  if (p.num_rows == 0 && !writes_back) return;
  const glue::DeviceGuard device_guard(inputs.device());
  const hipError_t status = launch_ple_conv(p, glue::current_stream());
  TORCH_CHECK(status == hipSuccess, "ple_conv: kernel launch failed: ", hipGetErrorString(status));
}

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  m.impl("ple_conv", &qwen4exp::ple_conv_gpu);
}
