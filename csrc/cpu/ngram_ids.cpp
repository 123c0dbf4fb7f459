// CPU kernel for ngram_ids (SPEC §3).
//
// Parallel over tokens. Tokens arrive sorted by request, so each worker binary-searches the
// request of its first token once and then walks forward; per token it builds the window once
// and derives the N-1 mixes incrementally into a block of mixes, and the block's heads are then
// reduced with the fast-modulo constants of csrc/common/fast_divmod.h (the same exact arithmetic
// as the GPU kernel): 8 heads a step with AVX-512, 4 with AVX2, one at a time otherwise, as
// cpu_ngram_hash_isa says (csrc/cpu/ngram_hash_simd.cpp).
#include <algorithm>

#include "../common/ngram_ids.h"
#include "ngram_hash_simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

template <typename OutT, int kMaxContext>
void ngram_ids_cpu_impl(const NgramIdsParams& p, int64_t isa) {
  const cpu::HeadLanes lanes(p.sizes, p.offsets, p.num_heads, p.heads_per_ngram);
  const int orders = p.context_len;  // orders 2..N, one mix each
  OutT* out = static_cast<OutT*>(p.output);

  // ~16 heads per token: below a few thousand tokens a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max(1, p.num_heads));
  cpu::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    const IndexView& qsl = p.query_start_loc;
    int64_t r = p.num_requests > 0 ? find_request(qsl, p.num_requests, begin) : -1;
    int64_t window[kMaxContext + 1];
    uint64_t mixes[cpu::kMixBlockTokens * cpu::kMixSlots];
    for (int64_t first = begin; first < end; first += cpu::kMixBlockTokens) {
      const int64_t count = std::min<int64_t>(cpu::kMixBlockTokens, end - first);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t t = first + i;
        while (r >= 0 && r + 1 < p.num_requests && qsl[r + 1] <= t) ++r;
        load_window<kMaxContext>(p, t, r, p.context_len, window);
        uint64_t* slots = mixes + i * cpu::kMixSlots;
        uint64_t mix = static_cast<uint64_t>(window[0]) * static_cast<uint64_t>(p.multipliers[0]);
        for (int o = 0; o < kMaxContext; ++o) {
          if (o < orders) {
            mix ^=
                static_cast<uint64_t>(window[o + 1]) * static_cast<uint64_t>(p.multipliers[o + 1]);
          }
          slots[o] = o < orders ? mix : 0;
        }
        // The vector kernels load all eight slots.
        for (int o = kMaxContext; o < cpu::kMixSlots; ++o) slots[o] = 0;
      }
      cpu::reduce_heads(isa, lanes, mixes, count, out + first * p.output_row_stride,
                        p.output_row_stride, p.output_col_stride);
    }
  });
}

}  // namespace

void run_ngram_ids_cpu(const NgramIdsParams& p, bool output_int64) {
  if (p.num_tokens == 0) return;
  const int64_t isa = cpu_ngram_hash_isa();
  // The released model's N = 3 gets a fully unrolled window; other orders share the generic one.
  if (p.context_len == 2) {
    output_int64 ? ngram_ids_cpu_impl<int64_t, 2>(p, isa) : ngram_ids_cpu_impl<int32_t, 2>(p, isa);
  } else {
    output_int64 ? ngram_ids_cpu_impl<int64_t, kMaxNgramSize - 1>(p, isa)
                 : ngram_ids_cpu_impl<int32_t, kMaxNgramSize - 1>(p, isa);
  }
}

}  // namespace qwen4exp
