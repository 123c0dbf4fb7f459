// Index vectors as the kernels read them, host and device: one view for every op's integer (or
// bool) index arguments, and the request search over query_start_loc that ngram_ids and ple_conv
// share (SPEC §1, batches). Torch-free.
#pragma once

#include "platform.h"

namespace qwen4exp {

// An int32/int64 (or bool/uint8) vector with a stride, read as int64; data == nullptr means
// "absent" (an optional argument not given).
struct IndexView {
  const void* data;
  int64_t stride;  // elements
  int32_t bytes;   // 1 (bool/uint8), 4 (int32) or 8 (int64)

  QWEN4EXP_HD bool present() const { return data != nullptr; }
  QWEN4EXP_HD int64_t operator[](int64_t i) const {
    const int64_t at = i * stride;
    if (bytes == 8) return static_cast<const int64_t*>(data)[at];
    if (bytes == 4) return static_cast<const int32_t*>(data)[at];
    return static_cast<const uint8_t*>(data)[at];
  }
};

// The request of token t: the last r with qsl[r] <= t, clamped to [0, R-1] (tokens past qsl[R]
// belong to the last request, as in vLLM). Binary search over qsl[1..R]; R >= 1.
QWEN4EXP_HD int64_t find_request(const IndexView& qsl, int64_t num_requests, int64_t t) {
  int64_t lo = 1, hi = num_requests + 1;  // the first index in [1, R+1) with qsl[index] > t
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (qsl[mid] <= t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int64_t r = lo - 1;
  return r < num_requests - 1 ? r : num_requests - 1;
}

}  // namespace qwen4exp
