// HIP kernel for ngram_ids (SPEC §3). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// One thread per output element (token t, head h; a thread takes several past 2^24 elements),
// with consecutive heads in consecutive threads, so the [T, NH] output is written fully
// coalesced. The NH threads of a token recompute its
// request and window; those reads hit the same cache lines and cost far less than the strided
// stores a thread-per-token layout would need. Each block first puts the NH heads' fast-modulo
// constants (fast_divmod.h) in shared memory, so no thread ever runs a 64-bit division in the
// hot path. They depend only on the layer: a caller that passes them precomputed
// (p.head_divmod, ops.ngram_head_divmod) has each block copy 32 bytes per head, where building
// them costs a 64-step bit loop per head, microseconds per block.
#include <cstring>
#include <limits>

#include "../common/ngram_ids.h"

namespace qwen4exp {
namespace {

constexpr int kThreadsPerBlock = 256;

// The id of one (token, head) element of the output.
template <typename OutT, int kMaxContext>
QWEN4EXP_DEVICE void ngram_id(const NgramIdsParams& p, const FastDivmodU64* head_mod,
                              int64_t element) {
  const int64_t t = element / p.num_heads;
  const int h = static_cast<int>(element - t * p.num_heads);
  static_cast<OutT*>(p.output)[t * p.output_row_stride + h * p.output_col_stride] =
      static_cast<OutT>(
          hashed_id<kMaxContext>(p, head_mod, t, h, std::numeric_limits<OutT>::max()));
}

// kMaxContext: N-1 for the common orders (the window then stays in registers), or the largest
// supported context for the rest.
template <typename OutT, int kMaxContext>
__global__ void __launch_bounds__(kThreadsPerBlock) ngram_ids_kernel(NgramIdsParams p) {
  QWEN4EXP_DYNAMIC_SHARED(FastDivmodU64, head_mod);
  for (int h = threadIdx.x; h < p.num_heads; h += blockDim.x) head_mod[h] = head_constants(p, h);
  __syncthreads();

  const int64_t elements = p.num_tokens * p.num_heads;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t element = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       element < elements; element += step) {
    ngram_id<OutT, kMaxContext>(p, head_mod, element);
  }
}

}  // namespace

hipError_t launch_ngram_ids(const NgramIdsParams& p, bool output_int64, hipStream_t stream) {
  const int64_t elements = p.num_tokens * p.num_heads;
  int64_t blocks = (elements + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks > kMaxGridX) blocks = kMaxGridX;
  // p.max_blocks: ngram_gather_rows' cap, where it runs this kernel (through_ids). The kernel
  // strides over its grid, so the ids are the same under any cap.
  if (p.max_blocks > 0 && blocks > p.max_blocks) blocks = p.max_blocks;
  const size_t shared = sizeof(FastDivmodU64) * static_cast<size_t>(p.num_heads);
  const auto launch = [&](auto kernel) {
    return launch_kernel(kernel, static_cast<unsigned>(blocks), kThreadsPerBlock, shared, stream,
                         p);
  };
  const bool i64 = output_int64;
  switch (p.context_len) {
    case 1:
      return i64 ? launch(ngram_ids_kernel<int64_t, 1>) : launch(ngram_ids_kernel<int32_t, 1>);
    case 2:  // the released model (N = 3)
      return i64 ? launch(ngram_ids_kernel<int64_t, 2>) : launch(ngram_ids_kernel<int32_t, 2>);
    case 3:
      return i64 ? launch(ngram_ids_kernel<int64_t, 3>) : launch(ngram_ids_kernel<int32_t, 3>);
    default:
      return i64 ? launch(ngram_ids_kernel<int64_t, kMaxNgramSize - 1>)
                 : launch(ngram_ids_kernel<int32_t, kMaxNgramSize - 1>);
  }
}

}  // namespace qwen4exp
