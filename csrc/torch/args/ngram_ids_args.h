// Argument checks and params for ngram_ids, shared by the CPU and GPU host entry points so both
// reject the same inputs with the same messages. Checks here look only at metadata (dtype, rank,
// shape, device); the CPU entry point additionally validates data values it can read for free.
#pragma once

#include <ATen/core/Tensor.h>

#include <limits>

#include "../../common/ngram_hash.h"
#include "tensor_args.h"

namespace qwen4exp {

inline bool is_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

// head_divmod: the layer's fast-modulo constants as ops.ngram_head_divmod returns them (the bytes
// of FastDivmodU64[NH]). Only their metadata is checked; their values need none (a kernel that
// reads them rebuilds every head whose stored divisor is not its size).
inline void check_head_divmod_arg(const char* op, const at::Tensor& head_divmod, int64_t num_heads,
                                  const c10::Device& device) {
  TORCH_CHECK(head_divmod.scalar_type() == at::kLong && head_divmod.dim() == 2 &&
                  head_divmod.size(0) == num_heads && head_divmod.size(1) == kFastDivmodWords,
              op, ": head_divmod must be int64 [NH, ", kFastDivmodWords, "] = [", num_heads, ", ",
              kFastDivmodWords, "] (ops.ngram_head_divmod(ngram_heads_vocab_sizes)), got ",
              head_divmod.scalar_type(), " ", head_divmod.sizes());
  TORCH_CHECK(head_divmod.is_contiguous(), op, ": head_divmod must be contiguous, got strides ",
              head_divmod.strides());
  TORCH_CHECK(head_divmod.device() == device, op, ": head_divmod is on ", head_divmod.device(),
              " but input_ids is on ", device);
  // The GPU kernel copies the constants with 16-byte loads; a fresh tensor always qualifies.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(head_divmod.data_ptr()) % 16 == 0, op,
              ": head_divmod must be 16-byte aligned (a view at an odd int64 offset is "
              "not); pass a fresh ops.ngram_head_divmod(...) tensor");
}

// The n-gram inputs of ngram_ids and ngram_gather_rows (`op` names the op in messages): the
// params without an output.
inline NgramIdsParams check_ngram_inputs(
    const char* op, const at::Tensor& input_ids, const at::Tensor& query_start_loc,
    const at::Tensor& ngram_context, const at::Tensor& layer_multipliers,
    const at::Tensor& head_sizes, const at::Tensor& head_offsets, int64_t eos_token_id,
    int64_t heads_per_ngram, const std::optional<at::Tensor>& head_divmod) {
  TORCH_CHECK(input_ids.dim() == 1, op, ": input_ids must be 1-D [T], got shape ",
              input_ids.sizes());
  TORCH_CHECK(is_index_dtype(input_ids.scalar_type()), op,
              ": input_ids must be int32 or int64, got ", input_ids.scalar_type());
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.numel() >= 1, op,
              ": query_start_loc must be 1-D [R+1] with R >= 0, got shape ",
              query_start_loc.sizes());
  TORCH_CHECK(is_index_dtype(query_start_loc.scalar_type()), op,
              ": query_start_loc must be int32 or int64, got ", query_start_loc.scalar_type());
  const int64_t num_requests = query_start_loc.numel() - 1;
  TORCH_CHECK(ngram_context.dim() == 2, op, ": ngram_context must be 2-D [R, N-1], got shape ",
              ngram_context.sizes());
  TORCH_CHECK(is_index_dtype(ngram_context.scalar_type()), op,
              ": ngram_context must be int32 or int64, got ", ngram_context.scalar_type());
  TORCH_CHECK(ngram_context.size(0) == num_requests, op, ": ngram_context has ",
              ngram_context.size(0), " rows but query_start_loc describes ", num_requests,
              " requests");
  const int64_t context_len = ngram_context.size(1);
  TORCH_CHECK(context_len >= 1 && context_len < kMaxNgramSize, op,
              ": ngram_context must have N-1 columns with 2 <= N <= ", kMaxNgramSize, ", got ",
              context_len, " columns");
  TORCH_CHECK(heads_per_ngram >= 1, op, ": heads_per_ngram must be >= 1, got ", heads_per_ngram);
  const int64_t num_heads = context_len * heads_per_ngram;
  TORCH_CHECK(num_heads <= kMaxNgramHeads, op, ": (N-1)·heads_per_ngram = ", num_heads,
              " heads is more than the supported ", kMaxNgramHeads);
  TORCH_CHECK(layer_multipliers.scalar_type() == at::kLong && layer_multipliers.dim() == 1 &&
                  layer_multipliers.numel() == context_len + 1,
              op, ": layer_multipliers must be int64 [N] = [", context_len + 1, "], got ",
              layer_multipliers.scalar_type(), " ", layer_multipliers.sizes());
  TORCH_CHECK(head_sizes.scalar_type() == at::kLong && head_sizes.dim() == 1 &&
                  head_sizes.numel() == num_heads,
              op, ": ngram_heads_vocab_sizes must be int64 [NH] = [", num_heads, "], got ",
              head_sizes.scalar_type(), " ", head_sizes.sizes());
  TORCH_CHECK(head_offsets.scalar_type() == at::kLong && head_offsets.dim() == 1 &&
                  head_offsets.numel() == num_heads,
              op, ": ngram_heads_offsets must be int64 [NH] = [", num_heads, "], got ",
              head_offsets.scalar_type(), " ", head_offsets.sizes());
  TORCH_CHECK(layer_multipliers.is_contiguous() && head_sizes.is_contiguous() &&
                  head_offsets.is_contiguous(),
              op,
              ": layer_multipliers, ngram_heads_vocab_sizes and ngram_heads_offsets must "
              "be contiguous");
  const auto device = input_ids.device();
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"query_start_loc", &query_start_loc},
      {"ngram_context", &ngram_context},
      {"layer_multipliers", &layer_multipliers},
      {"ngram_heads_vocab_sizes", &head_sizes},
      {"ngram_heads_offsets", &head_offsets}};
  for (const auto& [name, tensor] : others) {
    TORCH_CHECK(tensor->device() == device, op, ": ", name, " is on ", tensor->device(),
                " but input_ids is on ", device);
  }
  if (head_divmod.has_value()) check_head_divmod_arg(op, *head_divmod, num_heads, device);

  NgramIdsParams p{};
  p.input_ids = index_view(input_ids);
  p.query_start_loc = index_view(query_start_loc);
  p.context = index_view(ngram_context);  // rows and columns: context_row/col_stride
  p.context.stride = 1;
  p.context_row_stride = ngram_context.stride(0);
  p.context_col_stride = ngram_context.stride(1);
  p.multipliers = layer_multipliers.data_ptr<int64_t>();
  p.sizes = head_sizes.data_ptr<int64_t>();
  p.offsets = head_offsets.data_ptr<int64_t>();
  p.head_divmod = head_divmod.has_value()
                      ? reinterpret_cast<const FastDivmodU64*>(head_divmod->data_ptr<int64_t>())
                      : nullptr;
  p.num_tokens = input_ids.numel();
  p.num_requests = num_requests;
  p.eos_token_id = eos_token_id;
  p.context_len = static_cast<int32_t>(context_len);
  p.heads_per_ngram = static_cast<int32_t>(heads_per_ngram);
  p.num_heads = static_cast<int32_t>(num_heads);
  return p;
}

inline NgramIdsParams check_ngram_ids_args(
    const at::Tensor& input_ids, const at::Tensor& query_start_loc, const at::Tensor& ngram_context,
    const at::Tensor& layer_multipliers, const at::Tensor& head_sizes,
    const at::Tensor& head_offsets, int64_t eos_token_id, int64_t heads_per_ngram,
    const at::Tensor& output, const std::optional<at::Tensor>& head_divmod) {
  NgramIdsParams p = check_ngram_inputs("ngram_ids", input_ids, query_start_loc, ngram_context,
                                        layer_multipliers, head_sizes, head_offsets, eos_token_id,
                                        heads_per_ngram, head_divmod);
  TORCH_CHECK(output.dim() == 2 && output.size(0) == p.num_tokens && output.size(1) == p.num_heads,
              "ngram_ids: output must be [T, NH] = [", p.num_tokens, ", ", p.num_heads, "], got ",
              output.sizes());
  TORCH_CHECK(is_index_dtype(output.scalar_type()),
              "ngram_ids: output must be int64 or int32, got ", output.scalar_type());
  TORCH_CHECK(output.device() == input_ids.device(), "ngram_ids: output is on ", output.device(),
              " but input_ids is on ", input_ids.device());
  p.output = output.data_ptr();
  p.output_row_stride = output.stride(0);
  p.output_col_stride = output.stride(1);
  return p;
}

// Value checks (query_start_loc layout, head sizes and offsets) that need the index data on the
// host: always on the CPU path; on the GPU path only as opt-in debug checks
// (csrc/torch/gpu/debug_checks.h). The CPU can read the data for free, so it rejects layouts that
// the GPU kernel can only survive.
inline void check_ngram_ids_values(const NgramIdsParams& p, bool output_int32,
                                   const char* op = "ngram_ids") {
  const IndexView& qsl = p.query_start_loc;
  TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t r = 0; r < p.num_requests; ++r) {
    TORCH_CHECK(qsl[r + 1] >= qsl[r], op, ": query_start_loc must be non-decreasing, got ", qsl[r],
                " then ", qsl[r + 1], " at index ", r);
  }
  TORCH_CHECK(qsl[p.num_requests] <= p.num_tokens, op,
              ": query_start_loc[R] = ", qsl[p.num_requests], " is past the ", p.num_tokens,
              " tokens of input_ids");
  for (int h = 0; h < p.num_heads; ++h) {
    TORCH_CHECK(p.sizes[h] > 0, op, ": ngram_heads_vocab_sizes[", h, "] must be positive, got ",
                p.sizes[h]);
    TORCH_CHECK(p.offsets[h] >= 0, op, ": ngram_heads_offsets[", h, "] must be non-negative, got ",
                p.offsets[h]);
    TORCH_CHECK(p.offsets[h] <= std::numeric_limits<int64_t>::max() - p.sizes[h], op,
                ": ngram_heads_offsets[", h, "] + size overflows int64");
    if (output_int32) {
      TORCH_CHECK(p.offsets[h] + p.sizes[h] - 1 <= std::numeric_limits<int32_t>::max(), op,
                  ": an int32 output cannot hold head ", h, "'s ids (offset ", p.offsets[h],
                  " + size ", p.sizes[h], "); use an int64 output");
    }
  }
}

}  // namespace qwen4exp
