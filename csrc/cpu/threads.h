// The threads the CPU kernels run on. The kernels are torch-free, but who owns the threads is
// not theirs to decide: in the Python extension they are ATen's (so torch.set_num_threads
// applies; csrc/torch/cpu_ops.cpp), in the kernel library for C++ engines they are OpenMP's
// (csrc/cpu/threads_openmp.cpp; omp_set_num_threads applies). Each build links exactly one.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace qwen4exp::cpu {

// A borrowed callable void(int64_t begin, int64_t end): what a parallel_for hands its workers,
// without an allocation per call. It must outlive the call it is passed to.
class RangeFn {
 public:
  template <typename F>
  explicit RangeFn(const F& f)
      : object_(&f),
        call_([](const void* o, int64_t b, int64_t e) { (*static_cast<const F*>(o))(b, e); }) {}
  void operator()(int64_t begin, int64_t end) const { call_(object_, begin, end); }

 private:
  const void* object_;
  void (*call_)(const void*, int64_t, int64_t);
};

// The threads a parallel_for started now may use (at least 1).
int64_t num_threads();

// at::parallel_for's contract: splits [begin, end) into at most num_threads() contiguous chunks
// of at least `grain` items, runs fn(chunk_begin, chunk_end) on each concurrently, and returns
// when all are done. A range of fewer than `grain` items, or a call from inside a parallel_for,
// runs on the calling thread. The first exception a chunk throws is rethrown here.
void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn);

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  parallel_for_range(begin, end, grain, RangeFn(fn));
}

// Runs fn(block) once for every block in [0, blocks), on up to one thread per `grain` blocks.
// Each thread owns a contiguous share of the blocks, the same share on every call of the same
// size (parallel_for's chunks are static), so a call that repeats the previous one's rows finds
// them, and its output lines, in that core's own caches rather than the other cores'. A thread
// that finishes its share then takes blocks from the others' shares, front first, so one whose
// core is busy with something else holds no one up.
template <typename F>
void parallel_blocks(int64_t blocks, int64_t grain, const F& fn) {
  if (blocks <= 0) return;
  const int64_t shares = std::min(num_threads(), (blocks + std::max<int64_t>(grain, 1) - 1) /
                                                     std::max<int64_t>(grain, 1));
  if (shares <= 1) {
    for (int64_t block = 0; block < blocks; ++block) fn(block);
    return;
  }
  struct alignas(64) Share {  // a line each: the threads' counters never share one
    std::atomic<int64_t> next;
    int64_t end;
  };
  constexpr int64_t kLocalShares = 16;
  Share local[kLocalShares];
  std::unique_ptr<Share[]> heap(shares > kLocalShares ? new Share[shares] : nullptr);
  Share* const share = heap ? heap.get() : local;
  for (int64_t s = 0; s < shares; ++s) {
    share[s].next.store(blocks * s / shares, std::memory_order_relaxed);
    share[s].end = blocks * (s + 1) / shares;
  }
  const auto drain = [&](int64_t s) {
    for (int64_t block = share[s].next.fetch_add(1, std::memory_order_relaxed);
         block < share[s].end; block = share[s].next.fetch_add(1, std::memory_order_relaxed)) {
      fn(block);
    }
  };
  parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) drain(s);
    for (int64_t k = 0; k < shares - (end - begin); ++k) drain((end + k) % shares);
  });
}

}  // namespace qwen4exp::cpu
