// bf16 and fp16 as plain 16-bit patterns: bit-level conversions to and from fp32, host and device.
//
// Neither __half nor __hip_bfloat16 is used: Debian's hipcc (ROCm 5.2) has no hip_bf16.h, torch's
// ROCm build compiles with -D__HIP_NO_HALF_CONVERSIONS__/-D__HIP_NO_HALF_OPERATORS__, and the CPU
// kernels must build without a GPU toolkit. Every conversion is exact IEEE round-to-nearest-even
// (what torch's `.to()` does), written with integer operations only, so flush-to-zero modes
// cannot change it and the CPU compiler can vectorise it. NaN stays NaN (quiet).
#pragma once

#include <cstdint>
#include <cstring>

#include "platform.h"

namespace qwen4exp {

QWEN4EXP_HD uint32_t float_to_bits(float x) {
#if defined(QWEN4EXP_DEVICE_PASS)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

QWEN4EXP_HD float bits_to_float(uint32_t u) {
#if defined(QWEN4EXP_DEVICE_PASS)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

QWEN4EXP_HD float bf16_bits_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

QWEN4EXP_HD uint16_t float_to_bf16_bits(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

QWEN4EXP_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero or subnormal: m·2^-24, exact in fp32
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return bits_to_float(sign | float_to_bits(magnitude));
}

QWEN4EXP_HD uint16_t float_to_fp16_bits(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {  // >= 2^-14: a normal fp16; rebias 127 -> 15, round 13 bits away
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to zero
  // Subnormal result: m·2^(e-150) in units of 2^-24 is m >> (126 - e), then round to even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  const uint32_t kept = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t up = (rest > half || (rest == half && (kept & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | (kept + up));
}

}  // namespace qwen4exp
