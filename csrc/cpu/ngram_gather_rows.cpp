// CPU kernel for ngram_gather_rows: ngram_ids' CPU kernel (in the hash width cpu_ngram_hash_isa
// names: AVX-512, AVX2 or scalar) into a per-thread buffer of ids, then gather_rows' CPU kernel
// from it. A row's hash costs a few ns against the tens of its gather, the
// buffer (T·NH int64) stays in cache, and the op saves the caller a second dispatch, most of a
// decode step's lookup at small T.
#include <vector>

#include "../common/ngram_gather_rows.h"
#include "../common/ngram_ids.h"

namespace qwen4exp {

void run_ngram_gather_rows_cpu(const NgramGatherRowsParams& p) {
  const int64_t count = p.gather.num_tokens * p.gather.num_heads;
  if (count == 0) return;
  thread_local std::vector<int64_t> ids;
  ids.resize(static_cast<size_t>(count));
  const ThroughIds two = through_ids(p, ids.data());
  run_ngram_ids_cpu(two.hash, /*output_int64=*/true);
  run_gather_rows_cpu(two.gather);
}

}  // namespace qwen4exp
