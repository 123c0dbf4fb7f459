// Host glue for the HIP ple_gate kernel: checks -> params -> device guard -> current stream ->
// launch -> launch check. Compiled by the host compiler against the CUDA runtime headers (and
// hipified with the rest of the extension on ROCm, where the dispatch key is still CUDA), and
// for the SIMT emulator (glue.h).
#include "glue.h"

#include "../../common/ple_gate.h"
#include "../args/ple_gate_args.h"

namespace qwen4exp {
namespace {

void run_ple_gate_gpu(const PleGateParams& p, const at::Tensor& hidden) {
  if (p.num_tokens == 0) return;
  const glue::DeviceGuard device_guard(hidden.device());
  const hipError_t status = launch_ple_gate(p, glue::current_stream());
  TORCH_CHECK(status == hipSuccess, "ple_gate: kernel launch failed: ", hipGetErrorString(status));
}

std::tuple<at::Tensor, at::Tensor> ple_gate_gpu(const at::Tensor& key, const at::Tensor& value,
                                                const at::Tensor& hidden,
                                                const at::Tensor& norm_key_w,
                                                const at::Tensor& norm_query_w,
                                                const at::Tensor& norm_conv_w, double eps,
                                                c10::string_view rounding) {
  PleGateParams p = check_ple_gate_args(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w,
                                        eps, std::string(rounding));
  TORCH_CHECK(glue::on_kernel_device(hidden), "ple_gate: GPU kernel called with ", hidden.device(),
              " tensors");
  auto outputs = allocate_ple_gate_outputs(hidden, p);
  run_ple_gate_gpu(p, hidden);
  return outputs;
}

void ple_gate_out_gpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& hidden,
                      const at::Tensor& norm_key_w, const at::Tensor& norm_query_w,
                      const at::Tensor& norm_conv_w, double eps, c10::string_view rounding,
                      const at::Tensor& gated, const at::Tensor& conv_input) {
  PleGateParams p = check_ple_gate_args(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w,
                                        eps, std::string(rounding));
  TORCH_CHECK(glue::on_kernel_device(hidden), "ple_gate: GPU kernel called with ", hidden.device(),
              " tensors");
  check_ple_gate_outputs(hidden, gated, conv_input, p);
  run_ple_gate_gpu(p, hidden);
}

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  m.impl("ple_gate", &qwen4exp::ple_gate_gpu);
  m.impl("ple_gate_out", &qwen4exp::ple_gate_out_gpu);
}
