// Argument checks and params for ngram_gather_rows: ngram_ids' checks of its inputs and
// gather_rows' of its table and output, under the fused op's name, shared by the CPU and GPU host
// entry points.
#pragma once

#include "../../common/ngram_gather_rows.h"
#include "gather_rows_args.h"
#include "ngram_ids_args.h"

namespace qwen4exp {

constexpr const char* kNgramGatherRows = "ngram_gather_rows";

inline NgramGatherRowsParams check_ngram_gather_rows_args(
    const at::Tensor& input_ids, const at::Tensor& query_start_loc, const at::Tensor& ngram_context,
    const at::Tensor& layer_multipliers, const at::Tensor& head_sizes,
    const at::Tensor& head_offsets, int64_t eos_token_id, int64_t heads_per_ngram,
    const std::optional<at::Tensor>& head_divmod, const at::Tensor& table,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& block_scales,
    int64_t vocab_start, std::optional<int64_t> vocab_end, const at::Tensor& output,
    int64_t max_blocks) {
  NgramGatherRowsParams p{};
  p.ngram = check_ngram_inputs(kNgramGatherRows, input_ids, query_start_loc, ngram_context,
                               layer_multipliers, head_sizes, head_offsets, eos_token_id,
                               heads_per_ngram, head_divmod);
  p.gather = check_gather_table_args(kNgramGatherRows, table, scale, block_scales, vocab_start,
                                     vocab_end, output, max_blocks, p.ngram.num_tokens,
                                     p.ngram.num_heads);
  TORCH_CHECK(input_ids.device() == table.device(), kNgramGatherRows, ": input_ids is on ",
              input_ids.device(), " but table is on ", table.device());
  return p;
}

}  // namespace qwen4exp
