// Self-test of the SIMT emulator (csrc/simt): kernels that are right must give the right answer,
// and kernels with the bugs the emulator exists to catch must fail. Built by
// tests/test_simt_emulator.py for both wave sizes, with the assembly fiber switch and with the
// portable ucontext one (-DQWEN4EXP_SIMT_UCONTEXT), and by tools/check-sanitizers.sh under
// ASan+UBSan. Prints "ok <checks>" and exits 0, or names the failed check and exits 1.
//
//   g++ -std=c++17 -O2 -DQWEN4EXP_SIMT_WAVE_SIZE=64 -I csrc tests/cpp/simt_selftest.cpp
//       csrc/simt/runtime.cpp -o simt_selftest
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hip/block_reduce.h"
#include "common/platform.h"

namespace {

using qwen4exp::launch_kernel;
using qwen4exp::simt::kWaveSize;

int checks = 0;
int failures = 0;

void check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// The launch failed, and its message contains `needle`.
void check_fails(hipError_t status, hipError_t expected, const char* needle,
                 const std::string& what) {
  const std::string message = status == hipSuccess ? "" : hipGetErrorString(status);
  (void)hipGetLastError();
  check(status == expected && message.find(needle) != std::string::npos,
        what + " (status " + std::to_string(status) + ": " + message + ")");
}

constexpr int kThreads = 256;

// ---- coordinates -------------------------------------------------------------------------------

__global__ void coordinates_kernel(unsigned* out) {
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  out[block * threads + thread] = block * 1000 + thread;
}

void test_coordinates() {
  const dim3 grid(3, 2, 2), block(5, 4, 3);
  std::vector<unsigned> out(12 * 60, 0);
  check(launch_kernel(coordinates_kernel, grid, block, 0, nullptr, out.data()) == hipSuccess,
        "3-D launch runs");
  bool ok = true;
  for (unsigned b = 0; b < 12; ++b) {
    for (unsigned t = 0; t < 60; ++t) ok = ok && out[b * 60 + t] == b * 1000 + t;
  }
  check(ok, "every (block, thread) coordinate runs once");
}

// ---- barriers and shared memory ----------------------------------------------------------------

// Each thread writes its slot, then reads its neighbour's: right only with the barrier.
template <bool kBarrier>
__global__ void neighbour_kernel(float* out) {
  QWEN4EXP_SHARED(float[kThreads], slots);
  slots[threadIdx.x] = static_cast<float>(threadIdx.x + blockIdx.x);
  if (kBarrier) __syncthreads();
  out[blockIdx.x * kThreads + threadIdx.x] = slots[(threadIdx.x + 1) % kThreads];
}

void test_barrier() {
  std::vector<float> out(4 * kThreads);
  const auto wrong = [&]() {
    int n = 0;
    for (int b = 0; b < 4; ++b) {
      for (int t = 0; t < kThreads; ++t) {
        n += out[b * kThreads + t] != static_cast<float>((t + 1) % kThreads + b);
      }
    }
    return n;
  };
  check(launch_kernel(neighbour_kernel<true>, 4, kThreads, 0, nullptr, out.data()) == hipSuccess,
        "neighbour kernel runs");
  check(wrong() == 0, "with __syncthreads every thread reads its neighbour's value");
  check(launch_kernel(neighbour_kernel<false>, 4, kThreads, 0, nullptr, out.data()) == hipSuccess,
        "racy neighbour kernel runs");
  // Lanes run in a shuffled order: about half read before their neighbour wrote (poison, NaN).
  const int bad = wrong();
  check(bad > kThreads, "a missing __syncthreads gives wrong values (" + std::to_string(bad) +
                            " of " + std::to_string(4 * kThreads) + ")");
}

__global__ void uninitialised_shared_kernel(uint32_t* out) {
  QWEN4EXP_SHARED(uint32_t[8], words);
  if (threadIdx.x == 0) words[3] = 7;
  __syncthreads();
  out[threadIdx.x] = words[threadIdx.x % 8];
}

void test_poison() {
  std::vector<uint32_t> out(32);
  check(launch_kernel(uninitialised_shared_kernel, 1, 32, 0, nullptr, out.data()) == hipSuccess,
        "poison kernel runs");
  bool ok = true;
  for (int t = 0; t < 32; ++t) ok = ok && out[t] == (t % 8 == 3 ? 7u : 0xFFFFFFFFu);
  check(ok, "shared memory nobody wrote reads 0xFF bytes");
}

// Threads below 10 pass one more barrier than the rest (a compiler may merge the two barriers of
// an if/else into one, so the divergence here is one the code cannot lose).
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 10) __syncthreads();
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void barrier_after_return_kernel(int* out) {
  if (threadIdx.x >= 10) return;  // returned threads no longer take part (as on a GPU)
  __syncthreads();
  out[threadIdx.x] = 1;
}

void test_divergent_barrier() {
  std::vector<int> out(64);
  check_fails(launch_kernel(divergent_barrier_kernel, 1, 64, 0, nullptr, out.data()),
              hipErrorLaunchFailure, "different __syncthreads",
              "a barrier in divergent code fails");
  check(launch_kernel(barrier_after_return_kernel, 1, 64, 0, nullptr, out.data()) == hipSuccess,
        "a barrier after some threads returned passes");
}

// ---- shuffles and wave size --------------------------------------------------------------------

__global__ void shuffle_kernel(int* out, int mask, int width) {
  out[threadIdx.x] = __shfl_xor(static_cast<int>(threadIdx.x) * 3, mask, width);
}

void test_shuffles() {
  std::vector<int> out(128);
  bool ok = true;
  for (int width : {2, 8, kWaveSize}) {
    for (int mask = 1; mask < kWaveSize; mask *= 2) {
      if (launch_kernel(shuffle_kernel, 1, 128, 0, nullptr, out.data(), mask, width) !=
          hipSuccess) {
        ok = false;
        continue;
      }
      for (int t = 0; t < 128; ++t) {
        const int lane = t % kWaveSize;
        const int src = lane ^ mask;
        const int segment_end = (lane + width) & ~(width - 1);
        const int from = src < segment_end ? (t - lane + src) : t;
        ok = ok && out[t] == from * 3;
      }
    }
  }
  check(ok, "__shfl_xor reads lane ^ mask within its width");
}

// The project's own block reduction (csrc/hip/block_reduce.h).
__global__ void block_sum_kernel(const float* in, float* out) {
  QWEN4EXP_SHARED(float[kThreads / kWaveSize], scratch);
  float v[1] = {in[blockIdx.x * kThreads + threadIdx.x]};
  qwen4exp::block_sum<1, kThreads>(v, scratch);
  out[blockIdx.x * kThreads + threadIdx.x] = v[0];
}

// A reduction written for 32-lane waves: the butterfly starts at 16, but the partial sums are
// collected per real wave. On 64-wide waves lanes 32-63 of each wave are never added.
__global__ void wave32_reduction_kernel(const float* in, float* out) {
  QWEN4EXP_SHARED(float[kThreads / kWaveSize], partial);
  float v = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor(v, offset);
  if (threadIdx.x % kWaveSize == 0) partial[threadIdx.x / kWaveSize] = v;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < kThreads / kWaveSize; ++w) sum += partial[w];
  out[threadIdx.x] = sum;
}

// A second classic: the last step reduces the first 32 threads only.
__global__ void first_warp_reduction_kernel(const float* in, float* out) {
  if (threadIdx.x < 32) {
    float v = in[threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor(v, offset);
    out[threadIdx.x] = v;
  }
}

void test_reductions() {
  std::vector<float> in(3 * kThreads), out(3 * kThreads);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 7) + 0.25f;
  check(launch_kernel(block_sum_kernel, 3, kThreads, 0, nullptr, in.data(), out.data()) ==
            hipSuccess,
        "block_sum runs");
  bool ok = true;
  for (int b = 0; b < 3; ++b) {
    double expected = 0;
    for (int t = 0; t < kThreads; ++t) expected += in[b * kThreads + t];
    for (int t = 0; t < kThreads; ++t) ok = ok && out[b * kThreads + t] == expected;
  }
  check(ok, "block_sum gives every thread the block's total");

  double total = 0;
  for (int t = 0; t < kThreads; ++t) total += in[t];
  check(launch_kernel(wave32_reduction_kernel, 1, kThreads, 0, nullptr, in.data(), out.data()) ==
            hipSuccess,
        "32-lane reduction runs");
  check((out[0] == total) == (kWaveSize == 32),
        "a reduction written for 32 lanes is right at wave 32 and wrong at wave 64 (got " +
            std::to_string(out[0]) + ", total " + std::to_string(total) + ")");

  const hipError_t status =
      launch_kernel(first_warp_reduction_kernel, 1, 64, 0, nullptr, in.data(), out.data());
  if (kWaveSize == 32) {
    // clang-format off
    check(status == hipSuccess && out[0] == [&] {
      float s = 0;
      for (int t = 0; t < 32; ++t) s += in[t];
      return s;
    }(), "a first-warp reduction is right at wave 32");
    // clang-format on
  } else {
    check_fails(status, hipErrorLaunchFailure, "have returned or do not exist",
                "a shuffle over half a 64-lane wave fails");
  }
}

__global__ void divergent_shuffle_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 2 == 0) v = __shfl_xor(v, 1);
  v = __shfl_xor(v, 2);
  out[threadIdx.x] = v;
}

void test_divergent_shuffle() {
  std::vector<int> out(kWaveSize);
  check_fails(launch_kernel(divergent_shuffle_kernel, 1, kWaveSize, 0, nullptr, out.data()),
              hipErrorLaunchFailure, "different shuffles", "shuffles in divergent code fail");
}

// ---- dynamic shared memory and launch limits ----------------------------------------------------

struct alignas(16) Wide {
  uint64_t a, b;
};

__global__ void dynamic_shared_kernel(uint64_t* out, int n) {
  QWEN4EXP_DYNAMIC_SHARED(Wide, items);
  for (int i = threadIdx.x; i < n; i += blockDim.x) items[i] = Wide{uint64_t(i), uint64_t(2 * i)};
  __syncthreads();
  out[threadIdx.x] = reinterpret_cast<uintptr_t>(items) % alignof(Wide) == 0
                         ? items[(threadIdx.x * 7) % n].b
                         : ~uint64_t{0};
}

__global__ void big_static_shared_kernel(float* out) {
  QWEN4EXP_SHARED(float[8192], big);  // 32 KiB
  big[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = big[0];
}

__global__ void noop_kernel() {}

void test_dynamic_shared_and_limits() {
  std::vector<uint64_t> out(64);
  const int n = 100;
  check(launch_kernel(dynamic_shared_kernel, 2, 64, n * sizeof(Wide), nullptr, out.data(), n) ==
            hipSuccess,
        "dynamic shared kernel runs");
  bool ok = true;
  for (int t = 0; t < 64; ++t) ok = ok && out[t] == 2 * static_cast<uint64_t>((t * 7) % n);
  check(ok, "dynamic shared memory is aligned for its type and shared by the block");

  std::vector<float> f(64);
  check(launch_kernel(big_static_shared_kernel, 1, 64, 8192, nullptr, f.data()) == hipSuccess,
        "32 KiB static + 8 KiB dynamic shared memory fits");
  check_fails(launch_kernel(big_static_shared_kernel, 1, 64, 20000, nullptr, f.data()),
              hipErrorLaunchFailure, "shared memory", "32 KiB static + 20000 B dynamic fails");
  check_fails(launch_kernel(noop_kernel, 1, 1, 48 * 1024 + 1, nullptr),
              hipErrorInvalidConfiguration, "dynamic shared memory",
              "more than 48 KiB of dynamic shared memory is refused");
  check_fails(launch_kernel(noop_kernel, 1, 1025, 0, nullptr), hipErrorInvalidConfiguration,
              "threads is more than", "a 1025-thread block is refused");
  check_fails(launch_kernel(noop_kernel, dim3(1, 1, 1), dim3(32, 32, 2), 0, nullptr),
              hipErrorInvalidConfiguration, "threads is more than", "a 32x32x2 block is refused");
  check_fails(launch_kernel(noop_kernel, 0, 64, 0, nullptr), hipErrorInvalidConfiguration, "empty",
              "an empty grid is refused");
  check_fails(launch_kernel(noop_kernel, dim3(1, 65536), 64, 0, nullptr),
              hipErrorInvalidConfiguration, "past the limits", "grid.y = 65536 is refused");
  check_fails(launch_kernel(noop_kernel, dim3(1, 1, 65536), 64, 0, nullptr),
              hipErrorInvalidConfiguration, "past the limits", "grid.z = 65536 is refused");
  check_fails(launch_kernel(noop_kernel, dim3(1u << 31), 64, 0, nullptr),
              hipErrorInvalidConfiguration, "past the limits", "grid.x = 2^31 is refused");
  check_fails(launch_kernel(noop_kernel, dim3(1u << 24), 256, 0, nullptr),
              hipErrorInvalidConfiguration, "2^32 or more threads",
              "2^24 blocks of 256 threads are refused (ROCm counts threads in 32 bits)");
  check(hipGetLastError() == hipSuccess, "hipGetLastError clears the error");
  check(launch_kernel(noop_kernel, dim3(2, 65535, 1), 1, 0, nullptr) == hipSuccess,
        "grid.y = 65535 runs");
}

// ---- orders ------------------------------------------------------------------------------------

int sequence = 0;

__global__ void order_kernel(int* order) {
  // One launch runs one lane at a time, so this plain counter is the emulator's execution order.
  order[blockIdx.x * blockDim.x + threadIdx.x] = sequence++;
}

void test_orders() {
  const int threads = 64, blocks = 8;
  std::vector<int> first(threads * blocks), second(threads * blocks);
  sequence = 0;
  launch_kernel(order_kernel, blocks, threads, 0, nullptr, first.data());
  int in_order = 0;
  for (int i = 1; i < threads; ++i) in_order += first[i] == first[i - 1] + 1;
  check(in_order < threads / 2, "lanes run in a shuffled order");
  check(!std::equal(first.begin(), first.begin() + threads, first.begin() + threads),
        "blocks shuffle their lanes differently");
  const uint64_t seed = qwen4exp::simt::seed();
  qwen4exp::simt::set_seed(seed + 1);
  sequence = 0;
  launch_kernel(order_kernel, blocks, threads, 0, nullptr, second.data());
  check(first != second, "another seed gives another order");
  qwen4exp::simt::set_seed(seed);
  sequence = 0;
  launch_kernel(order_kernel, blocks, threads, 0, nullptr, second.data());
  check(first == second, "the same seed gives the same order");
}

}  // namespace

int main() {
  test_coordinates();
  test_barrier();
  test_poison();
  test_divergent_barrier();
  test_shuffles();
  test_reductions();
  test_divergent_shuffle();
  test_dynamic_shared_and_limits();
  test_orders();
  if (failures > 0) {
    std::printf("%d of %d checks failed (wave size %d)\n", failures, checks, kWaveSize);
    return 1;
  }
  std::printf("ok %d checks (wave size %d)\n", checks, kWaveSize);
  return 0;
}
