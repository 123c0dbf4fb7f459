// CPU kernel for ngram_ids (SPEC §3).
//
// Parallel over tokens. Tokens arrive sorted by request, so each worker binary-searches the
// request of its first token once and then walks forward; per token it builds the window once,
// derives the N-1 mixes incrementally, and reduces each head with the precomputed fast-modulo
// constants of csrc/common/fast_divmod.h (the same exact arithmetic as the GPU kernel).
#include <algorithm>
#include <vector>

#include "../common/ngram_ids.h"
#include "threads.h"

namespace qwen4exp {
namespace {

template <typename OutT, int kMaxContext>
void ngram_ids_cpu_impl(const NgramIdsParams& p) {
  std::vector<FastDivmodU64> head_mod(p.num_heads);
  for (int h = 0; h < p.num_heads; ++h) head_mod[h] = make_fast_divmod(p.sizes[h]);
  const int orders = p.context_len;  // orders 2..N, one mix each
  const int per_order = p.heads_per_ngram;
  OutT* out = static_cast<OutT*>(p.output);

  // ~16 heads per token: below a few thousand tokens a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max(1, p.num_heads));
  cpu::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    const IndexView& qsl = p.query_start_loc;
    int64_t r = p.num_requests > 0 ? find_request(qsl, p.num_requests, begin) : -1;
    int64_t window[kMaxContext + 1];
    for (int64_t t = begin; t < end; ++t) {
      while (r >= 0 && r + 1 < p.num_requests && qsl[r + 1] <= t) ++r;
      load_window<kMaxContext>(p, t, r, p.context_len, window);
      OutT* row = out + t * p.output_row_stride;
      uint64_t mix = static_cast<uint64_t>(window[0]) * static_cast<uint64_t>(p.multipliers[0]);
      for (int o = 0; o < orders; ++o) {
        mix ^= static_cast<uint64_t>(window[o + 1]) * static_cast<uint64_t>(p.multipliers[o + 1]);
        const int64_t signed_mix = static_cast<int64_t>(mix);
        for (int k = 0; k < per_order; ++k) {
          const int h = o * per_order + k;
          row[h * p.output_col_stride] =
              static_cast<OutT>(floor_mod_i64(head_mod[h], signed_mix) + p.offsets[h]);
        }
      }
    }
  });
}

}  // namespace

void run_ngram_ids_cpu(const NgramIdsParams& p, bool output_int64) {
  if (p.num_tokens == 0) return;
  // The released model's N = 3 gets a fully unrolled window; other orders share the generic one.
  if (p.context_len == 2) {
    output_int64 ? ngram_ids_cpu_impl<int64_t, 2>(p) : ngram_ids_cpu_impl<int32_t, 2>(p);
  } else {
    output_int64 ? ngram_ids_cpu_impl<int64_t, kMaxNgramSize - 1>(p)
                 : ngram_ids_cpu_impl<int32_t, kMaxNgramSize - 1>(p);
  }
}

}  // namespace qwen4exp
