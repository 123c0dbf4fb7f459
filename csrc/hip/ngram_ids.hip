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

// Half of one head's FastDivmodU64: the unit of the 16-byte loads of precomputed constants.
struct alignas(16) DivmodHalf {
  uint64_t word[2];
};
static_assert(sizeof(FastDivmodU64) == 2 * sizeof(DivmodHalf), "two 16-byte loads per head");

// Head h's constants: the precomputed ones when there are some for this very size, else built
// here. A non-positive size cannot come from a valid layout (the CPU path rejects it); its ids
// become -1 in ngram_id, which every gather treats as out of range (a zero row), and its
// constants are those of 1, never read. A stored divisor other than the size (constants built for
// another layout, or from before the sizes were reloaded) is rebuilt, so stale constants cost
// time, never wrong ids.
QWEN4EXP_DEVICE FastDivmodU64 head_constants(const NgramIdsParams& p, int h) {
  const int64_t size = p.sizes[h];
  if (p.head_divmod != nullptr && size > 0) {
    const DivmodHalf* stored = reinterpret_cast<const DivmodHalf*>(p.head_divmod) + 2 * h;
    const DivmodHalf low = stored[0];
    const DivmodHalf high = stored[1];
    FastDivmodU64 f;
    memcpy(&f, &low, sizeof(low));
    memcpy(reinterpret_cast<char*>(&f) + sizeof(low), &high, sizeof(high));
    if (f.divisor == static_cast<uint64_t>(size)) return f;
  }
  return make_fast_divmod(size > 0 ? static_cast<uint64_t>(size) : 1);
}

// The id of one (token, head) element of the output.
template <typename OutT, int kMaxContext>
QWEN4EXP_DEVICE void ngram_id(const NgramIdsParams& p, const FastDivmodU64* head_mod,
                              int64_t element) {
  const int64_t t = element / p.num_heads;
  const int h = static_cast<int>(element - t * p.num_heads);
  const int order = h / p.heads_per_ngram + 2;

  const int64_t r = p.num_requests > 0 ? find_request(p.query_start_loc, p.num_requests, t) : -1;
  int64_t window[kMaxContext + 1];
  load_window<kMaxContext>(p, t, r, order - 1, window);
  const int64_t mix = mix_window<kMaxContext + 1>(window, p.multipliers, order);

  // Offsets that no valid layout has (the CPU path rejects them): an id that would be negative,
  // overflow int64 or not fit an int32 output is -1 too, never a wrapped id that gathers some
  // other head's row.
  constexpr int64_t kMaxId = std::numeric_limits<OutT>::max();
  int64_t id = -1;
  const int64_t size = p.sizes[h];
  if (size > 0) {
    // In [0, size) unless the caller's constants were corrupted (their divisor matches, their
    // multiplier does not): such a residue gives -1 too, never an overflow.
    const int64_t residue = floor_mod_i64(head_mod[h], mix);
    const int64_t offset = p.offsets[h];
    if (residue >= 0 && residue < size && offset <= kMaxId - residue && residue + offset >= 0) {
      id = residue + offset;
    }
  }
  static_cast<OutT*>(p.output)[t * p.output_row_stride + h * p.output_col_stride] =
      static_cast<OutT>(id);
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
  const int64_t needed = (elements + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const unsigned blocks = static_cast<unsigned>(needed < kMaxGridX ? needed : kMaxGridX);
  const size_t shared = sizeof(FastDivmodU64) * static_cast<size_t>(p.num_heads);
  const auto launch = [&](auto kernel) {
    return launch_kernel(kernel, blocks, kThreadsPerBlock, shared, stream, p);
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
