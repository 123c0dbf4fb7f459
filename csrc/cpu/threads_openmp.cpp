// The CPU kernels' threads in the torch-free kernel library (csrc/cpu/threads.h): OpenMP's, as
// ATen's are on its OpenMP backend, with the same chunking, so that the kernels split their work
// the same way in both builds.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>

#include "threads.h"

namespace qwen4exp::cpu {

int64_t num_threads() { return std::max(1, omp_get_max_threads()); }

void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn) {
  if (begin >= end) return;
  const int64_t items = end - begin;
  if (items < grain || omp_in_parallel()) {
    fn(begin, end);
    return;
  }
  const int64_t chunks_wanted = grain > 0 ? (items + grain - 1) / grain : items;
  const int tasks = static_cast<int>(std::min(num_threads(), chunks_wanted));
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  // An exception must not leave an OpenMP region: the first one is kept for the caller. The
  // chunks follow the team OpenMP actually gives, which may be smaller than the one asked for.
#pragma omp parallel num_threads(tasks)
  {
    const int64_t team = omp_get_num_threads();
    const int64_t chunk = (items + team - 1) / team;
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) {
      try {
        fn(first, std::min(end, first + chunk));
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace qwen4exp::cpu
