// Argument checks and params for read_file_rows (csrc/common/read_file_rows.h), a host op: the
// tensors' metadata and the scalars. The fd (open, readable, O_DIRECT or not) and each owned id's
// offset are checked by run_read_file_rows_cpu, also before anything is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <limits>
#include <string>

#include "../../common/read_file_rows.h"

namespace qwen4exp {

// `ids` is the flat view of the caller's ids (ids.reshape(-1): a copy only where no flat view of
// them exists), which the caller keeps alive while the params are in use.
inline ReadFileRowsParams check_read_file_rows_args(int64_t fd, const at::Tensor& ids,
                                                    int64_t data_offset, int64_t row_bytes,
                                                    int64_t vocab_start, int64_t vocab_end,
                                                    const at::Tensor& output, int64_t io_threads,
                                                    const std::string& path) {
  constexpr const char* op = "read_file_rows";
  TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op,
              ": ids must be int32 or int64, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1, op, ": ids must be flat here (the op flattens them), got shape ",
              ids.sizes());
  TORCH_CHECK(row_bytes > 0, op, ": row_bytes must be positive, got ", row_bytes);
  TORCH_CHECK(data_offset >= 0, op, ": data_offset must be >= 0, got ", data_offset);
  TORCH_CHECK(vocab_start >= 0 && vocab_end >= vocab_start, op,
              ": the ids read, [vocab_start, vocab_end) = [", vocab_start, ", ", vocab_end,
              "), must satisfy 0 <= vocab_start <= vocab_end");
  const int64_t n = ids.numel();
  TORCH_CHECK(output.scalar_type() == at::kByte, op, ": output must be uint8, got ",
              output.scalar_type());
  TORCH_CHECK(output.dim() == 2 && output.size(0) == n && output.size(1) == row_bytes, op,
              ": output must be [ids.numel(), row_bytes] = [", n, ", ", row_bytes, "], got ",
              output.sizes());
  TORCH_CHECK(output.stride(1) == 1 || row_bytes == 1, op,
              ": output rows must be contiguous (stride(1) == 1), got strides ", output.strides());
  TORCH_CHECK(n <= 1 || output.stride(0) >= row_bytes, op,
              ": output rows must not overlap (stride(0) >= row_bytes), got strides ",
              output.strides());
  TORCH_CHECK(ids.device().is_cpu() && output.device().is_cpu(), op,
              ": reads into host memory: ids and output must be CPU tensors, got ids on ",
              ids.device(), " and output on ", output.device());
  TORCH_CHECK(fd >= 0 && fd <= std::numeric_limits<int>::max(), op, ": ",
              path.empty() ? "fd " + std::to_string(fd) : path, ": fd must be an open file ",
              "descriptor, got ", fd);

  ReadFileRowsParams p{};
  p.fd = static_cast<int>(fd);
  p.ids = ids.data_ptr();
  p.ids_stride = ids.stride(0);
  p.ids_int64 = ids.scalar_type() == at::kLong;
  p.num_ids = n;
  p.data_offset = data_offset;
  p.row_bytes = row_bytes;
  p.vocab_start = vocab_start;
  p.vocab_end = vocab_end;
  p.output = static_cast<uint8_t*>(output.data_ptr());
  p.output_row_stride = output.stride(0);
  p.io_threads = io_threads;
  p.path = path.c_str();
  return p;
}

}  // namespace qwen4exp
