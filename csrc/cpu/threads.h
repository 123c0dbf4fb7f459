// The threads the CPU kernels run on. The kernels are torch-free, but who owns the threads is
// not theirs to decide: in the Python extension they are ATen's (so torch.set_num_threads
// applies; csrc/cpu_ops.cpp), in the kernel library for C++ engines they are OpenMP's
// (csrc/cpu/threads_openmp.cpp; omp_set_num_threads applies). Each build links exactly one.
#pragma once

#include <cstdint>

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

}  // namespace qwen4exp::cpu
