// Host glue for the HIP gather_rows kernel: checks -> params -> device guard -> current stream ->
// launch -> launch check. The table may be an ordinary device tensor or the device view of pinned
// host memory (csrc/torch/gpu/host_table.cpp): to the kernel both are just a device address.
#include "glue.h"

#include "../args/gather_rows_args.h"
#include "../../common/gather_rows.h"

namespace qwen4exp {
namespace {

void gather_rows_gpu(const at::Tensor& table, const at::Tensor& ids,
                     const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& block_scales, int64_t vocab_start,
                     std::optional<int64_t> vocab_end, const at::Tensor& output,
                     int64_t max_blocks) {
  // p.max_blocks caps the grid of every launch (csrc/hip/gather_rows.hip, grid_for).
  const GatherRowsParams p = check_gather_rows_args(table, ids, scale, block_scales, vocab_start,
                                                    vocab_end, output, max_blocks);
  TORCH_CHECK(glue::on_kernel_device(table), "gather_rows: GPU kernel called with ", table.device(),
              " tensors");
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  const glue::DeviceGuard device_guard(table.device());
  const hipError_t status = launch_gather_rows(p, glue::current_stream());
  TORCH_CHECK(status == hipSuccess,
              "gather_rows: kernel launch failed: ", hipGetErrorString(status));
}

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  m.impl("gather_rows", &qwen4exp::gather_rows_gpu);
}
