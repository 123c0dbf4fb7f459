// Host glue for the HIP gather_rows kernel: checks -> params -> device guard -> current stream ->
// launch -> launch check. The table may be an ordinary device tensor or the device view of pinned
// host memory (csrc/gpu/host_table.cpp): to the kernel both are just a device address.
#define QWEN4EXP_GPU_HOST_GLUE 1

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>

#include "../gather_rows_args.h"
#include "../hip/gather_rows.h"

namespace qwen4exp {
namespace {

void gather_rows_gpu(const at::Tensor& table, const at::Tensor& ids,
                     const std::optional<at::Tensor>& scale, int64_t vocab_start,
                     int64_t vocab_end, const at::Tensor& output) {
  const GatherRowsParams p =
      check_gather_rows_args(table, ids, scale, vocab_start, vocab_end, output);
  TORCH_CHECK(table.is_cuda(), "gather_rows: GPU kernel called with ", table.device(),
              " tensors");
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  const c10::cuda::CUDAGuard device_guard(table.device());
  const hipError_t status = launch_gather_rows(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == hipSuccess, "gather_rows: kernel launch failed: ",
              hipGetErrorString(status));
}

}  // namespace
}  // namespace qwen4exp

TORCH_LIBRARY_IMPL(qwen4exp, CUDA, m) {
  m.impl("gather_rows", &qwen4exp::gather_rows_gpu);
}
