// Wave- and block-wide fp32 sums for the HIP kernels, written against the wave size of the pass
// being compiled (platform.h): 64 on CDNA (MI200/MI300), 32 on RDNA and NVIDIA. Never assumes 32.
#pragma once

#include "../common/float_types.h"
#include "../common/platform.h"

namespace qwen4exp {

// The wave size of this device pass. Host passes parse device code without running it and get
// a placeholder of 1, which keeps them well-formed (no modulo by zero).
constexpr int kWaveSize = QWEN4EXP_WAVE_SIZE > 0 ? QWEN4EXP_WAVE_SIZE : 1;

#if defined(QWEN4EXP_KERNEL_COMPILE)

// Sums each of N values over a wave (butterfly: every lane gets the totals).
template <int N>
QWEN4EXP_DEVICE void wave_sum(float (&v)[N]) {
#pragma unroll
  for (int offset = kWaveSize / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += shuffle_xor(v[n], offset);
  }
}

// Sums each of N values over a block of kThreads threads (a multiple of the wave size); every
// thread gets the totals, added in the same order in every thread (deterministic). The leading
// barrier lets consecutive calls share `scratch` ([N · kThreads / kWaveSize] floats, shared).
template <int N, int kThreads>
QWEN4EXP_DEVICE void block_sum(float (&v)[N], float* scratch) {
  constexpr int kWaves = kThreads / kWaveSize;
  wave_sum(v);
  const int lane = threadIdx.x % kWaveSize;
  const int wave = threadIdx.x / kWaveSize;
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n * kWaves + wave] = v[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float sum = 0.f;
    for (int w = 0; w < kWaves; ++w) sum += scratch[n * kWaves + w];
    v[n] = sum;
  }
}

// Loads and stores of VEC consecutive elements as fp32; VEC·sizeof(T) is 16 bytes (one 128-bit
// access, the pointer 16-byte aligned) or VEC is 1.
template <typename T, int VEC>
QWEN4EXP_DEVICE void load_floats(const T* p, float (&out)[VEC]) {
  if constexpr (VEC == 1) {
    out[0] = to_float(p[0]);
  } else {
    static_assert(VEC * sizeof(T) == 16, "vector accesses are 16 bytes");
    union {
      uint4 raw;
      T v[VEC];
    } u;
    u.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(u.v[i]);
  }
}

template <typename T, int VEC>
QWEN4EXP_DEVICE void store_floats(T* p, const float (&in)[VEC]) {
  if constexpr (VEC == 1) {
    p[0] = from_float<T>(in[0]);
  } else {
    static_assert(VEC * sizeof(T) == 16, "vector accesses are 16 bytes");
    // The 128-bit word is assembled with shifts, not through a union of 16-bit elements: hipcc
    // built that union for fp16 in scratch memory (32 bytes per thread on gfx90a/gfx940, eight
    // 16-bit stores and four 32-bit loads per chunk; tools/kernel_report.py).
    uint32_t word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (sizeof(T) == 4) {
        word[w] = float_to_bits(in[w]);
      } else {
        word[w] = static_cast<uint32_t>(from_float<T>(in[2 * w]).bits) |
                  (static_cast<uint32_t>(from_float<T>(in[2 * w + 1]).bits) << 16);
      }
    }
    uint4 raw;
    raw.x = word[0];
    raw.y = word[1];
    raw.z = word[2];
    raw.w = word[3];
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

#endif  // QWEN4EXP_KERNEL_COMPILE

// True when `bytes` (an address or a byte stride) is a multiple of 16.
QWEN4EXP_HD bool aligned16(uint64_t bytes) { return (bytes & 15u) == 0; }

}  // namespace qwen4exp
