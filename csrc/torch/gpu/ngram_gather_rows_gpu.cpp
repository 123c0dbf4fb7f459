// Host glue for ngram_gather_rows on the GPU: checks -> params -> device guard -> current stream ->
// the fused kernel (csrc/hip/gather_rows.hip: each block hashes the ids of the rows it gathers);
// where that kernel does not apply (an order other than N = 3, an NVFP4 table, rows or output not
// in 16-byte pieces, a table without rows), ngram_ids' and gather_rows' kernels through an ids
// buffer.
#include <ATen/ops/empty.h>

#include "glue.h"

#include "../../common/ngram_gather_rows.h"
#include "../../common/ngram_ids.h"
#include "debug_checks.h"
#include "../args/ngram_gather_rows_args.h"

namespace qwen4exp {
namespace {

void ngram_gather_rows_gpu(const at::Tensor& input_ids, const at::Tensor& query_start_loc,
                           const at::Tensor& ngram_context, const at::Tensor& layer_multipliers,
                           const at::Tensor& ngram_heads_vocab_sizes,
                           const at::Tensor& ngram_heads_offsets, int64_t eos_token_id,
                           int64_t heads_per_ngram, const std::optional<at::Tensor>& head_divmod,
                           const at::Tensor& table, const std::optional<at::Tensor>& scale,
                           const std::optional<at::Tensor>& block_scales, int64_t vocab_start,
                           std::optional<int64_t> vocab_end, const at::Tensor& output,
                           int64_t max_blocks) {
  // p.gather.max_blocks caps the grid of every launch below, the fallback's ids kernel included
  // (through_ids).
  const NgramGatherRowsParams p = check_ngram_gather_rows_args(
      input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,
      ngram_heads_offsets, eos_token_id, heads_per_ngram, head_divmod, table, scale, block_scales,
      vocab_start, vocab_end, output, max_blocks);
  TORCH_CHECK(glue::on_kernel_device(table), kNgramGatherRows, ": GPU kernel called with ",
              table.device(), " tensors");
  if (debug_checks_enabled()) {
    debug_check_ngram_values(p.ngram, query_start_loc, ngram_heads_vocab_sizes, ngram_heads_offsets,
                             /*output_int32=*/false, kNgramGatherRows);
  }
  if (p.gather.num_tokens == 0 || p.gather.num_heads == 0 || p.gather.width == 0) return;
  const glue::DeviceGuard device_guard(table.device());
  const hipStream_t stream = glue::current_stream();
  bool launched = false;
  hipError_t status = launch_ngram_gather_rows(p, stream, &launched);
  if (status == hipSuccess && !launched) {
    const at::Tensor ids =
        at::empty({p.gather.num_tokens, p.gather.num_heads}, input_ids.options().dtype(at::kLong));
    const ThroughIds two = through_ids(p, ids.data_ptr<int64_t>());
    status = launch_ngram_ids(two.hash, /*output_int64=*/true, stream);
    if (status == hipSuccess) status = launch_gather_rows(two.gather, stream);
  }
  TORCH_CHECK(status == hipSuccess, kNgramGatherRows,
              ": kernel launch failed: ", hipGetErrorString(status));
}

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  m.impl("ngram_gather_rows", &qwen4exp::ngram_gather_rows_gpu);
}
