// Argument checks and params for gather_rows, shared by the CPU and GPU host entry points so both
// reject the same inputs with the same messages. Only metadata is checked: ids are data, and an
// id out of range is not an error but a zero row (SPEC §4), on every backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <limits>

#include "../../common/gather_rows.h"
#include "tensor_args.h"

namespace qwen4exp {

// The table, dequantisation, shard, output and grid-cap arguments of gather_rows and
// ngram_gather_rows (`op` names the op in messages) for T = num_tokens tokens of NH = num_heads
// heads: the params without the ids.
inline GatherRowsParams check_gather_table_args(const char* op, const at::Tensor& table,
                                                const std::optional<at::Tensor>& scale,
                                                const std::optional<at::Tensor>& block_scales,
                                                int64_t vocab_start,
                                                std::optional<int64_t> vocab_end_or_none,
                                                const at::Tensor& output, int64_t max_blocks,
                                                int64_t num_tokens, int64_t num_heads) {
  GatherRowsParams p{};
  TORCH_CHECK(table.dim() == 2, op, ": table must be 2-D [rows, d], got shape ", table.sizes());
  TORCH_CHECK(dtype_of(table.scalar_type(), &p.table_dtype), op,
              ": table must be float32, bfloat16, float16, float8_e4m3fn, "
              "float8_e4m3fnuz or uint8 (NVFP4), got ",
              table.scalar_type());
  TORCH_CHECK(table.stride(1) == 1 || table.size(1) <= 1, op,
              ": table rows must be contiguous (stride(1) == 1), got strides ", table.strides());
  const int64_t rows = table.size(0);
  TORCH_CHECK(vocab_end_or_none.has_value() ||
                  vocab_start <= std::numeric_limits<int64_t>::max() - rows,
              op,
              ": vocab_start + rows (the default vocab_end) must fit in int64, got "
              "vocab_start ",
              vocab_start, " with ", rows, " table rows");
  const int64_t vocab_end = vocab_end_or_none.value_or(vocab_start + rows);
  const bool nvfp4 = p.table_dtype == Dtype::kNvfp4;
  const int64_t width = table.size(1) * elems_per_word(p.table_dtype);
  TORCH_CHECK(output.dim() == 2 && output.size(0) == num_tokens &&
                  output.size(1) == num_heads * width,
              op, ": output must be [T, NH·d] = [", num_tokens, ", ", num_heads * width, "], got ",
              output.sizes());
  TORCH_CHECK(dtype_of(output.scalar_type(), &p.out_dtype) && is_float_dtype(p.out_dtype), op,
              ": output must be float32, bfloat16 or float16, got ", output.scalar_type());
  TORCH_CHECK(output.stride(1) == 1 || output.size(1) <= 1, op,
              ": output rows must be contiguous (stride(1) == 1), got strides ", output.strides());
  TORCH_CHECK(vocab_start >= 0 && vocab_end >= vocab_start && vocab_end - vocab_start <= rows, op,
              ": shard [vocab_start, vocab_end) = [", vocab_start, ", ", vocab_end,
              ") must satisfy 0 <= vocab_start <= vocab_end <= vocab_start + rows (", rows,
              " table rows)");
  const auto device = table.device();
  TORCH_CHECK(output.device() == device, op, ": output is on ", output.device(),
              " but table is on ", device);
  if (nvfp4) {
    TORCH_CHECK(block_scales.has_value(), op,
                ": a uint8 table is NVFP4 [rows, d/2] and needs its block_scales "
                "(float8_e4m3fn [rows, d/16])");
    TORCH_CHECK(width % kNvfp4Block == 0, op, ": an NVFP4 row holds a multiple of ", kNvfp4Block,
                " elements, so the packed width d/2 must be a multiple of ", kNvfp4Block / 2,
                ", got ", table.size(1));
    const at::Tensor& bs = *block_scales;
    TORCH_CHECK(bs.scalar_type() == at::kFloat8_e4m3fn, op,
                ": block_scales must be float8_e4m3fn, got ", bs.scalar_type());
    TORCH_CHECK(bs.dim() == 2 && bs.size(0) == rows && bs.size(1) == width / kNvfp4Block, op,
                ": block_scales must be [rows, d/16] = [", rows, ", ", width / kNvfp4Block,
                "] for a packed table of shape ", table.sizes(), ", got ", bs.sizes());
    TORCH_CHECK(bs.stride(1) == 1 || bs.size(1) <= 1, op,
                ": block_scales rows must be contiguous (stride(1) == 1), got strides ",
                bs.strides());
    TORCH_CHECK(bs.device() == device, op, ": block_scales is on ", bs.device(),
                " but table is on ", device);
    p.block_scales = static_cast<const uint8_t*>(bs.data_ptr());
    p.block_scales_row_stride = bs.stride(0);
  } else {
    TORCH_CHECK(!block_scales.has_value(), op,
                ": block_scales is only defined for NVFP4 (uint8) tables, got a ",
                table.scalar_type(), " table");
    p.block_scales = nullptr;
    p.block_scales_row_stride = 0;
  }
  if (is_fp8(p.table_dtype) || nvfp4) {
    TORCH_CHECK(scale.has_value(), op, ": ",
                nvfp4 ? "an NVFP4 table needs its global fp32 scale (vLLM's weight_scale_2)"
                      : "an fp8 table needs its per-tensor scale");
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1, op,
                ": scale must be one float32 element, got ", scale->scalar_type(), " with shape ",
                scale->sizes());
    TORCH_CHECK(scale->device() == device, op, ": scale is on ", scale->device(),
                " but table is on ", device);
    p.scale = scale->data_ptr<float>();
  } else {
    TORCH_CHECK(!scale.has_value(), op, ": scale is only defined for fp8 and NVFP4 tables, got a ",
                table.scalar_type(), " table");
    p.scale = nullptr;
  }

  p.table = table.data_ptr();
  p.table_row_stride = table.stride(0);
  p.rows = rows;
  p.width = width;
  p.output = output.data_ptr();
  p.output_row_stride = output.stride(0);
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.vocab_start = vocab_start;
  p.vocab_end = vocab_end;
  // Checked on every backend, though only the GPU launchers read it.
  TORCH_CHECK(max_blocks >= 0, op, ": max_blocks must be >= 0 (0: no cap), got ", max_blocks);
  p.max_blocks = max_blocks;
  return p;
}

inline GatherRowsParams check_gather_rows_args(const at::Tensor& table, const at::Tensor& ids,
                                               const std::optional<at::Tensor>& scale,
                                               const std::optional<at::Tensor>& block_scales,
                                               int64_t vocab_start,
                                               std::optional<int64_t> vocab_end_or_none,
                                               const at::Tensor& output, int64_t max_blocks) {
  TORCH_CHECK(ids.dim() == 2, "gather_rows: ids must be 2-D [T, NH], got shape ", ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
              "gather_rows: ids must be int32 or int64, got ", ids.scalar_type());
  GatherRowsParams p = check_gather_table_args("gather_rows", table, scale, block_scales,
                                               vocab_start, vocab_end_or_none, output, max_blocks,
                                               ids.size(0), ids.size(1));
  TORCH_CHECK(ids.device() == table.device(), "gather_rows: ids is on ", ids.device(),
              " but table is on ", table.device());
  p.ids = ids.data_ptr();
  p.ids_row_stride = ids.stride(0);
  p.ids_col_stride = ids.stride(1);
  p.ids_int64 = ids.scalar_type() == at::kLong;
  return p;
}

}  // namespace qwen4exp
