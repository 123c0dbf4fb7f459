// The SIMT emulator: runs the HIP kernels of csrc/hip/ on the CPU, built by the host C++ compiler.
//
// A kernel source sees what a GPU compile gives it: threadIdx/blockIdx/blockDim/gridDim,
// __syncthreads, wave shuffles, static and dynamic shared memory (through the two macros of
// platform.h), uint2/uint4/dim3, __umul64hi and the bit casts. csrc/hip/platform.h includes this
// header when QWEN4EXP_SIMT_WAVE_SIZE (32 or 64) is defined; the wave size is a compile-time
// choice, as it is for a GPU target.
//
// How a launch runs (runtime.cpp): blocks one after another, each block's threads ("lanes") as
// cooperative fibers on one OS thread. A lane runs until it reaches a barrier, a shuffle or its
// end; when no lane can run, the scheduler releases a wave whose live lanes all wait at the same
// shuffle, or the block when every live lane waits at the same __syncthreads, and reports a
// deadlock (a divergent barrier or shuffle) otherwise. Lanes run in an order shuffled with a
// seeded generator at every step and shared memory is filled with 0xFF bytes (NaN as floats)
// when a block starts, so a missing barrier or a read of unwritten shared memory gives a wrong
// result rather than a lucky one. Launches a GPU would refuse fail here too (launch_limits in
// runtime.cpp). What it cannot show: timing, the GPU memory model (no two blocks ever run at
// once), and the device compiler's floating-point code.
//
// Everything here is torch-free: the same runtime serves the Python extension modules
// (qwen4exp_ext._simt32/_simt64) and the C++ self-test (tests/cpp/simt_selftest.cpp).
#pragma once

#if !defined(QWEN4EXP_SIMT_WAVE_SIZE)
#error "csrc/simt/runtime.h needs QWEN4EXP_SIMT_WAVE_SIZE (32 or 64)"
#endif
#if QWEN4EXP_SIMT_WAVE_SIZE != 32 && QWEN4EXP_SIMT_WAVE_SIZE != 64
#error "QWEN4EXP_SIMT_WAVE_SIZE must be 32 or 64"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

// ---- The GPU's vector types, in the global namespace as on a GPU -----------------------------

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

// ---- Runtime names the launchers and the host glue use ---------------------------------------

// One in-order queue: a launch has finished when it returns, so the stream is only a token.
using hipStream_t = struct qwen4exp_simt_stream*;
enum hipError_t : int {
  hipSuccess = 0,
  hipErrorInvalidValue = 1,
  hipErrorInvalidConfiguration = 9,
  hipErrorLaunchFailure = 719,
};
// The last error of this OS thread, cleared by reading it (hipGetLastError's contract).
hipError_t hipGetLastError();
// For an error the emulator raised, the message that says what went wrong.
const char* hipGetErrorString(hipError_t error);

#define __global__
#define __launch_bounds__(...)

namespace qwen4exp {
namespace simt {

constexpr int kWaveSize = QWEN4EXP_SIMT_WAVE_SIZE;
constexpr unsigned kMaxThreadsPerBlock = 1024;
// Static plus dynamic shared memory of one block: CUDA's limit without an opt-in, which is also
// below AMD's 64 KiB of LDS, so a kernel that launches here launches on both vendors.
constexpr size_t kMaxSharedBytes = 48 * 1024;

// The built-in coordinates of the lane whose code is running (one launch runs at a time).
struct LaneCoordinates {
  uint3 thread_idx;
  uint3 block_idx;
  uint3 block_dim;
  uint3 grid_dim;
};
extern const LaneCoordinates* current_lane_coordinates;

// A barrier or shuffle in the source: lanes must meet at the same one.
struct Site {
  const char* file;
  int line;
};
// Blocks the calling lane until every live lane of its block reached this same barrier.
void sync_block(Site site);
// Exchanges a 64-bit word with the lane `self ^ mask` of the calling lane's wave; every lane of
// the wave must call it together, at the same site (a lane that has returned fails the launch).
uint64_t shuffle_xor_bits(uint64_t bits, int mask, int width, Site site);
// Storage of one `__shared__` object of this block, made (0xFF-filled) by the first lane that
// declares it; `tag` identifies the declaration.
void* static_shared(const void* tag, size_t bytes, size_t align);
// The block's dynamic shared memory (the launch's `shared_bytes`).
void* dynamic_shared(size_t align);

// Type-erased body of a launch: `run(context)` executes the kernel once for the current lane.
struct KernelBody {
  void (*run)(const void* context);
  const void* context;
};
hipError_t launch(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes);

// The seed of the lane orders (default 0; QWEN4EXP_SIMT_SEED in the environment at load).
void set_seed(uint64_t seed);
uint64_t seed();

// The launches asked of the emulator since the last take_launch_record (or the load), refused
// ones included: how many, and the most blocks one of them had. What a test reads a launcher's
// grid from (gather_rows' max_blocks cap); taking it starts the next record.
struct LaunchRecord {
  uint64_t launches;
  uint64_t most_blocks;
};
LaunchRecord take_launch_record();

// A launch with the signature of `kernel<<<grid, block, shared_bytes>>>(args...)`. The arguments
// are converted to the kernel's parameter types once, as a GPU launch copies them, and every lane
// calls the kernel with its own copy.
template <typename... Params, typename... Args>
hipError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                  const Args&... args) {
  struct Context {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  };
  const Context context{kernel, std::tuple<std::decay_t<Params>...>(args...)};
  const KernelBody body{[](const void* c) {
                          const Context& ctx = *static_cast<const Context*>(c);
                          std::apply(ctx.kernel, ctx.params);
                        },
                        &context};
  return launch(body, grid, block, shared_bytes);
}

template <typename T>
T shuffle_xor(T value, int mask, int width, Site site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move 32/64-bit words");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shuffle_xor_bits(bits, mask, width, site);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

// High word of a 64x64-bit product from 32-bit limbs, as GPUs compute it (no 128-bit type here,
// so this is independent of the host branch of qwen4exp::mul_hi_u64).
inline uint64_t umul64hi(uint64_t a, uint64_t b) {
  const uint64_t a_lo = a & 0xFFFFFFFFu, a_hi = a >> 32;
  const uint64_t b_lo = b & 0xFFFFFFFFu, b_hi = b >> 32;
  const uint64_t lo_lo = a_lo * b_lo;
  const uint64_t hi_lo = a_hi * b_lo;
  const uint64_t lo_hi = a_lo * b_hi;
  const uint64_t hi_hi = a_hi * b_hi;
  const uint64_t middle = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
  return hi_hi + (hi_lo >> 32) + (middle >> 32);
}

}  // namespace simt
}  // namespace qwen4exp

// ---- Built-ins of kernel code -------------------------------------------------------------------

#define threadIdx (::qwen4exp::simt::current_lane_coordinates->thread_idx)
#define blockIdx (::qwen4exp::simt::current_lane_coordinates->block_idx)
#define blockDim (::qwen4exp::simt::current_lane_coordinates->block_dim)
#define gridDim (::qwen4exp::simt::current_lane_coordinates->grid_dim)

// The source line of each barrier and shuffle names it (a code address would not: the compiler
// may merge or outline calls).
#define __syncthreads() ::qwen4exp::simt::sync_block(::qwen4exp::simt::Site{__FILE__, __LINE__})

template <typename T>
T __shfl_xor(T value, int mask, int width = QWEN4EXP_SIMT_WAVE_SIZE,
             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::qwen4exp::simt::shuffle_xor(value, mask, width, ::qwen4exp::simt::Site{file, line});
}

// CUDA's form: every lane of the wave must take part (the only mask our kernels use).
template <typename T>
T __shfl_xor_sync(unsigned long long lanes, T value, int mask, int width = QWEN4EXP_SIMT_WAVE_SIZE,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  (void)lanes;  // the emulator always requires the whole wave
  return ::qwen4exp::simt::shuffle_xor(value, mask, width, ::qwen4exp::simt::Site{file, line});
}

inline uint64_t __umul64hi(uint64_t a, uint64_t b) { return ::qwen4exp::simt::umul64hi(a, b); }

inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
