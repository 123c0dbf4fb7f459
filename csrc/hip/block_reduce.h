// Group-wide fp32 sums (wave shuffles, then shared memory across waves), device conversions between
// fp32 and bf16/fp16, and 128-bit row accesses for the HIP kernels, written against the wave size
// of the pass being compiled (platform.h): 64 on CDNA (MI200/MI300), 32 on RDNA and NVIDIA. Never
// assumes 32.
#pragma once

#include <type_traits>

#include "../common/float_types.h"
#include "../common/platform.h"

namespace qwen4exp {

// The wave size of this device pass. Host passes parse device code without running it and get
// a placeholder of 1, which keeps them well-formed (no modulo by zero).
constexpr int kWaveSize = QWEN4EXP_WAVE_SIZE > 0 ? QWEN4EXP_WAVE_SIZE : 1;

#if defined(QWEN4EXP_KERNEL_COMPILE)

// Sums each of N values over a group of 2^group_log2 consecutive threads of a block of kThreads
// (each group aligned to its size); every thread of the group gets the totals, added in the same
// order in each (deterministic, and the same bits in every lane: an xor butterfly adds each pair
// both ways round, and fp32 addition commutes). Within a wave the group's lanes add by shuffles;
// a group of several waves then adds its waves' totals through `scratch` ([N · kThreads /
// kWaveSize] floats, shared) in wave order. group_log2 is the same in the whole block, and every
// thread of the block calls this (there are barriers when a group spans waves); the leading
// barrier lets consecutive calls share `scratch`.
template <int N, int kThreads>
QWEN4EXP_DEVICE void group_sum(float (&v)[N], int group_log2, float* scratch) {
  const int group = 1 << group_log2;
#pragma unroll
  for (int offset = kWaveSize / 2; offset > 0; offset /= 2) {
    if (offset < group) {
#pragma unroll
      for (int n = 0; n < N; ++n) v[n] += shuffle_xor(v[n], offset);
    }
  }
  if (group > kWaveSize) {
    constexpr int kWaves = kThreads / kWaveSize;
    const int lane = threadIdx.x % kWaveSize;
    const int wave = threadIdx.x / kWaveSize;
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int n = 0; n < N; ++n) scratch[n * kWaves + wave] = v[n];
    }
    __syncthreads();
    const int waves = group / kWaveSize;
    const int first = wave & ~(waves - 1);
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float sum = 0.f;
      for (int w = 0; w < waves; ++w) sum += scratch[n * kWaves + first + w];
      v[n] = sum;
    }
  }
}

// Sums each of N values over a block of kThreads threads (a power of two): group_sum with the
// block as its one group.
template <int N, int kThreads>
QWEN4EXP_DEVICE void block_sum(float (&v)[N], float* scratch) {
  static_assert(kThreads > 0 && (kThreads & (kThreads - 1)) == 0, "a power-of-two block");
  int log2 = 0;
  while ((1 << log2) < kThreads) ++log2;  // folded: kThreads is a constant
  group_sum<N, kThreads>(v, log2, scratch);
}

// fp32 <-> bf16/fp16 with the device's conversion instructions where it has them: the same bits
// as float_types.h's integer emulation (round to nearest even, subnormals kept, overflow to inf)
// for every value but NaN, which stays a quiet NaN of the hardware's sign and payload. AMD
// gfx90a/gfx940: v_cvt_f16_f32 and v_cvt_f32_f16 (these targets have no bf16 conversion: bf16
// keeps the emulation, a few integer operations); NVIDIA sm_80+: cvt.rn.f16.f32, cvt.rn.bf16.f32
// and cvt.f32.f16. Elsewhere (the SIMT emulator, host passes) the emulation itself.
QWEN4EXP_DEVICE float widen(float x) { return x; }
QWEN4EXP_DEVICE float widen(bf16_t x) { return to_float(x); }
QWEN4EXP_DEVICE float widen(f16_t x) {
#if defined(__HIP_DEVICE_COMPILE__)
  return static_cast<float>(__builtin_bit_cast(_Float16, x.bits));
#elif defined(__CUDA_ARCH__)
  float out;
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(x.bits));
  return out;
#else
  return to_float(x);
#endif
}

template <typename T>
QWEN4EXP_DEVICE T narrow(float x) {
#if defined(__HIP_DEVICE_COMPILE__)
  if constexpr (std::is_same_v<T, f16_t>) {
    return f16_t{__builtin_bit_cast(uint16_t, static_cast<_Float16>(x))};
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, f16_t>) {
    uint16_t bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    return f16_t{bits};
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    uint16_t bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    return bf16_t{bits};
  }
#endif
  return from_float<T>(x);
}

// x rounded to T and read back (float_types.h's round_to, on the conversion instructions).
template <typename T>
QWEN4EXP_DEVICE float round_through(float x) {
  return widen(narrow<T>(x));
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
