// The n-gram hash of SPEC §3, as host/device helpers shared by the CPU kernel
// (csrc/cpu/ngram_ids.cpp) and the HIP kernel (csrc/hip/ngram_ids.hip): one definition of the
// window, the EOS barrier and the mix, so the two backends cannot drift apart.
//
// Every index a kernel derives from data (request starts, context columns, token positions) is
// range-checked here and reads EOS when it falls outside its tensor: the CPU glue rejects such
// inputs before launching, and on the GPU, where the host cannot see the data, a malformed
// query_start_loc still never reads out of bounds.
#pragma once

#include <cstring>

#include "fast_divmod.h"
#include "index_view.h"
#include "platform.h"

namespace qwen4exp {

// Largest supported n-gram order; windows live in registers. The released model uses N = 3.
constexpr int kMaxNgramSize = 8;
// Most heads NH = (N-1)·K_h (the released model: 16): the GPU kernel keeps a 32-byte divisor per
// head in shared memory, and 1024 of them (32 KiB) fit the 48 KiB a block has on every GPU.
constexpr int kMaxNgramHeads = 1024;

struct NgramIdsParams {
  IndexView input_ids;        // [T]
  IndexView query_start_loc;  // [R + 1]
  IndexView context;          // [R, N-1]: element (r, c) at index r·row_stride + c·col_stride
  int64_t context_row_stride;
  int64_t context_col_stride;
  const int64_t* multipliers;  // [N], contiguous
  const int64_t* sizes;        // [NH], contiguous
  const int64_t* offsets;      // [NH], contiguous
  void* output;                // [T, NH] int64 or int32
  int64_t output_row_stride;
  int64_t output_col_stride;
  int64_t num_tokens;    // T
  int64_t num_requests;  // R
  int64_t eos_token_id;
  int32_t context_len;      // N - 1, in [1, kMaxNgramSize - 1]
  int32_t heads_per_ngram;  // K_h
  int32_t num_heads;        // NH = (N - 1) · K_h
  // [NH], 16-byte aligned, or nullptr (after every field above, so that an initialiser written
  // before it leaves it null): the fast-modulo constants of `sizes`, make_fast_divmod per head,
  // computed once per layer (ops.ngram_head_divmod). The GPU kernel copies them instead of
  // building them in every block, and builds a head whose stored divisor is not sizes[h] (stale
  // constants) itself; the CPU kernel builds its own (nanoseconds, with the host's 128-bit
  // division), never reading them.
  const FastDivmodU64* head_divmod;
  // The GPU launcher's cap on its grid, 0 for none (the CPU kernel ignores it): what
  // GatherRowsParams::max_blocks is to the gather, for the ids kernel that ngram_gather_rows runs
  // where its fused kernel does not apply (through_ids). The ngram_ids op leaves it 0.
  int64_t max_blocks;
};

// Fills window[s] (s = 1..depth, of kMaxDepth + 1 entries) with the s-th predecessor of token t
// under the EOS barrier: walking back from t, the first EOS met is kept and every older position
// reads EOS. window[0] is the token itself and never masked. r < 0 means "no request" (R = 0): all
// predecessors EOS. kMaxDepth bounds depth at compile time so the loop unrolls and, on the GPU, the
// window stays in registers (a dynamically indexed array would live in scratch memory).
template <int kMaxDepth>
QWEN4EXP_HD void load_window(const NgramIdsParams& p, int64_t t, int64_t r, int depth,
                             int64_t* window) {
  window[0] = p.input_ids[t];
  const int64_t eos = p.eos_token_id;
  const int64_t start = r >= 0 ? p.query_start_loc[r] : 0;
  const int64_t pos = t - start;  // position of t in its request's chunk
  bool crossed = false;
  QWEN4EXP_UNROLL
  for (int s = 1; s <= kMaxDepth; ++s) {  // fixed trip count (no break): fully unrollable
    // Past depth: 0, never read (mix_window stops at the order), but written, so that the
    // compiler sees every entry defined (GCC warned of each as maybe uninitialised).
    int64_t token = 0;
    if (s <= depth) {
      token = eos;
      if (!crossed && r >= 0) {
        if (pos >= s) {
          const int64_t src = t - s;
          if (src >= 0 && src < p.num_tokens) token = p.input_ids[src];
        } else {
          const int64_t col = p.context_len - s + pos;
          if (col >= 0 && col < p.context_len) {
            token = p.context[r * p.context_row_stride + col * p.context_col_stride];
          }
        }
      }
      crossed = crossed || token == eos;
    }
    window[s] = token;
  }
}

// mix_n = XOR over k < n of window[k]·m_k, in int64 with wrap-around (unsigned arithmetic, so the
// wrap is defined behaviour in C++). kMaxOrder bounds `order` at compile time, as above.
template <int kMaxOrder>
QWEN4EXP_HD int64_t mix_window(const int64_t* window, const int64_t* multipliers, int order) {
  uint64_t mix = 0;
  QWEN4EXP_UNROLL
  for (int k = 0; k < kMaxOrder; ++k) {
    if (k < order) mix ^= static_cast<uint64_t>(window[k]) * static_cast<uint64_t>(multipliers[k]);
  }
  return static_cast<int64_t>(mix);
}

// Half of one head's FastDivmodU64: the unit of the 16-byte loads of precomputed constants.
struct alignas(16) DivmodHalf {
  uint64_t word[2];
};
static_assert(sizeof(FastDivmodU64) == 2 * sizeof(DivmodHalf), "two 16-byte loads per head");

// Head h's constants for the GPU kernels (ngram_ids, ngram_gather_rows), which keep them in shared
// memory: the precomputed ones when there are some for this very size, else built here. A
// non-positive size cannot come from a valid layout (the CPU path rejects it); its ids become -1
// in hashed_id, which every gather treats as out of range (a zero row), and its constants are
// those of 1, never read. A stored divisor other than the size (constants built for another
// layout, or from before the sizes were reloaded) is rebuilt, so stale constants cost time, never
// wrong ids.
QWEN4EXP_HD FastDivmodU64 head_constants(const NgramIdsParams& p, int h) {
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

// The id of token t's head h for the GPU kernels, with head h's constants in head_mod[h]: its
// window, its order's mix, floor-mod the head size plus the head offset. Offsets that no valid
// layout has (the CPU path rejects them): an id that would be negative, overflow int64 or exceed
// max_id (the output type's largest value) is -1, never a wrapped id that gathers some other
// head's row. kMaxContext: N-1 for the common orders (the window then stays in registers), or
// the largest supported context for the rest.
template <int kMaxContext>
QWEN4EXP_HD int64_t hashed_id(const NgramIdsParams& p, const FastDivmodU64* head_mod, int64_t t,
                              int h, int64_t max_id) {
  const int order = h / p.heads_per_ngram + 2;
  const int64_t r = p.num_requests > 0 ? find_request(p.query_start_loc, p.num_requests, t) : -1;
  int64_t window[kMaxContext + 1];
  load_window<kMaxContext>(p, t, r, order - 1, window);
  const int64_t mix = mix_window<kMaxContext + 1>(window, p.multipliers, order);
  const int64_t size = p.sizes[h];
  if (size <= 0) return -1;
  // In [0, size) unless the caller's constants were corrupted (their divisor matches, their
  // multiplier does not): such a residue gives -1 too, never an overflow.
  const int64_t residue = floor_mod_i64(head_mod[h], mix);
  const int64_t offset = p.offsets[h];
  if (residue >= 0 && residue < size && offset <= max_id - residue && residue + offset >= 0) {
    return residue + offset;
  }
  return -1;
}

}  // namespace qwen4exp
