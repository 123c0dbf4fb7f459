// Eight-lane fp32 vectors for the CPU kernels (GCC/Clang vector extensions), with loads and
// stores of fp32, bf16 and fp16 rows, and the function multi-versioning of the hot loops.
//
// The wheel is built for baseline x86-64 (SSE2). Hot loops are written on these vectors and
// compiled a second and third time for AVX2+FMA (x86-64-v3) and AVX-512 (x86-64-v4) through GCC's
// target_clones: the loader picks the best clone once, for the CPU it runs on. Templated bodies
// are force-inlined into the clones so they get the clone's instruction set. Eight lanes is also
// the lane count of numpy's pairwise summation, which ple_gate's "vllm" rounding reproduces.
//
// 16-bit conversions are the integer round-to-nearest-even of float16.h, lane by lane.
#pragma once

#include <cstdint>
#include <cstring>

#include "../common/float_types.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(QWEN4EXP_NO_CPU_CLONES)
#define QWEN4EXP_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QWEN4EXP_CPU_CLONES
#endif

#define QWEN4EXP_ALWAYS_INLINE inline __attribute__((always_inline))
// Lambdas in a clone are separate functions compiled for the baseline target: force them inline,
// or their vector code (and their vector ABI) would not be the clone's.
#define QWEN4EXP_LAMBDA_INLINE __attribute__((always_inline))

// The vector types below are passed only between force-inlined functions inside one clone, so
// GCC's note that their calling convention differs between instruction sets does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace qwen4exp {
namespace simd {

constexpr int kLanes = 8;
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

QWEN4EXP_ALWAYS_INLINE f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
QWEN4EXP_ALWAYS_INLINE u32x8 splat_u(uint32_t x) { return u32x8{x, x, x, x, x, x, x, x}; }
QWEN4EXP_ALWAYS_INLINE f32x8 as_f32(u32x8 u) { return (f32x8)u; }
QWEN4EXP_ALWAYS_INLINE u32x8 as_u32(f32x8 f) { return (u32x8)f; }

// ---- 16-bit patterns <-> fp32 lanes (exact RNE, NaN stays NaN) -------------------------------

QWEN4EXP_ALWAYS_INLINE f32x8 bf16x8_to_f32(u16x8 h) {
  return as_f32(__builtin_convertvector(h, u32x8) << 16);
}

QWEN4EXP_ALWAYS_INLINE u32x8 f32_to_bf16x8_bits(f32x8 x) {  // in the low 16 bits of each lane
  const u32x8 u = as_u32(x);
  const u32x8 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const u32x8 nan = (u >> 16) | 0x40u;
  return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? nan : rounded;
}

QWEN4EXP_ALWAYS_INLINE f32x8 f16x8_to_f32(u16x8 h16) {
  const u32x8 h = __builtin_convertvector(h16, u32x8);
  const u32x8 sign = (h & 0x8000u) << 16;
  const u32x8 exponent = (h >> 10) & 0x1Fu;
  const u32x8 mantissa = h & 0x3FFu;
  const u32x8 normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  const u32x8 special = sign | 0x7F800000u | (mantissa << 13);
  const f32x8 sub_magnitude = __builtin_convertvector(mantissa, f32x8) * 5.9604644775390625e-8f;
  const u32x8 subnormal = sign | as_u32(sub_magnitude);
  return as_f32(exponent == 31u ? special : (exponent != 0u ? normal : subnormal));
}

QWEN4EXP_ALWAYS_INLINE u32x8 f32_to_f16x8_bits(f32x8 x) {
  const u32x8 u = as_u32(x);
  const u32x8 sign = (u >> 16) & 0x8000u;
  const u32x8 a = u & 0x7FFFFFFFu;
  const u32x8 nan = sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  const u32x8 inf = sign | 0x7C00u;
  const u32x8 r = a - 0x38000000u;
  const u32x8 normal = sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  // |x| < 2^-14: |x|·2^24 is exact; adding 2^23 rounds it to an integer, to nearest even.
  const f32x8 scaled = as_f32(a) * 16777216.0f + 8388608.0f;
  const u32x8 subnormal = sign | (as_u32(scaled) - 0x4B000000u);
  return a > 0x7F800000u ? nan : (a >= 0x477FF000u ? inf : (a >= 0x38800000u ? normal : subnormal));
}

// ---- typed loads, stores and rounding ---------------------------------------------------------

QWEN4EXP_ALWAYS_INLINE f32x8 load(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
QWEN4EXP_ALWAYS_INLINE f32x8 load(const bf16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return bf16x8_to_f32(h);
}
QWEN4EXP_ALWAYS_INLINE f32x8 load(const f16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return f16x8_to_f32(h);
}

// Storage bits of x in T, as 16-bit lanes (16-bit T only).
template <typename T>
QWEN4EXP_ALWAYS_INLINE u16x8 to_bits(f32x8 x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return __builtin_convertvector(f32_to_bf16x8_bits(x), u16x8);
  } else {
    return __builtin_convertvector(f32_to_f16x8_bits(x), u16x8);
  }
}

QWEN4EXP_ALWAYS_INLINE void store(float* p, f32x8 x) { std::memcpy(p, &x, sizeof(x)); }
QWEN4EXP_ALWAYS_INLINE void store(bf16_t* p, f32x8 x) {
  const u16x8 h = to_bits<bf16_t>(x);
  std::memcpy(p, &h, sizeof(h));
}
QWEN4EXP_ALWAYS_INLINE void store(f16_t* p, f32x8 x) {
  const u16x8 h = to_bits<f16_t>(x);
  std::memcpy(p, &h, sizeof(h));
}

// x rounded to T and read back.
template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x8 round(f32x8 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return as_f32(f32_to_bf16x8_bits(x) << 16);
  } else {
    return f16x8_to_f32(__builtin_convertvector(f32_to_f16x8_bits(x), u16x8));
  }
}

// The first n (< 8) elements, zero-padded; and the matching partial store.
template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x8 load_partial(const T* p, int n) {
  T tmp[kLanes];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, sizeof(T) * n);
  return load(tmp);
}
template <typename T>
QWEN4EXP_ALWAYS_INLINE void store_partial(T* p, f32x8 x, int n) {
  T tmp[kLanes];
  store(tmp, x);
  std::memcpy(static_cast<void*>(p), tmp, sizeof(T) * n);
}
// Lanes [0, n) of a row, for n in [1, 8].
template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x8 load_n(const T* p, int n) {
  return n == kLanes ? load(p) : load_partial(p, n);
}
template <typename T>
QWEN4EXP_ALWAYS_INLINE void store_n(T* p, f32x8 x, int n) {
  if (n == kLanes) {
    store(p, x);
  } else {
    store_partial(p, x, n);
  }
}

}  // namespace simd
}  // namespace qwen4exp
