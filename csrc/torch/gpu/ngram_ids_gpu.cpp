// Host glue for the HIP ngram_ids kernel: checks -> params -> device guard -> current stream ->
// launch -> launch check. Compiled by the host compiler against the CUDA runtime headers (and
// hipified with the rest of the extension on ROCm, where the dispatch key is still CUDA), and
// for the SIMT emulator (glue.h).
#include "glue.h"

#include "debug_checks.h"
#include "../../common/ngram_ids.h"
#include "../args/ngram_ids_args.h"

namespace qwen4exp {
namespace {

void ngram_ids_gpu(const at::Tensor& input_ids, const at::Tensor& query_start_loc,
                   const at::Tensor& ngram_context, const at::Tensor& layer_multipliers,
                   const at::Tensor& ngram_heads_vocab_sizes, const at::Tensor& ngram_heads_offsets,
                   int64_t eos_token_id, int64_t heads_per_ngram, const at::Tensor& output,
                   const std::optional<at::Tensor>& head_divmod) {
  const NgramIdsParams p = check_ngram_ids_args(
      input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,
      ngram_heads_offsets, eos_token_id, heads_per_ngram, output, head_divmod);
  TORCH_CHECK(glue::on_kernel_device(input_ids), "ngram_ids: GPU kernel called with ",
              input_ids.device(), " tensors");
  if (debug_checks_enabled()) {
    debug_check_ngram_values(p, query_start_loc, ngram_heads_vocab_sizes, ngram_heads_offsets,
                             output.scalar_type() == at::kInt, "ngram_ids");
  }
  if (p.num_tokens == 0) return;
  const glue::DeviceGuard device_guard(input_ids.device());
  const hipError_t status =
      launch_ngram_ids(p, output.scalar_type() == at::kLong, glue::current_stream());
  TORCH_CHECK(status == hipSuccess, "ngram_ids: kernel launch failed: ", hipGetErrorString(status));
}

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  m.impl("ngram_ids", &qwen4exp::ngram_ids_gpu);
}
