// Typed 16-bit storage for the ple_gate/ple_conv kernels: bf16_t and f16_t wrap the bit patterns
// of float16.h, so one kernel template serves fp32, bf16 and fp16 through to_float / from_float.
// c10::BFloat16 and c10::Half have the same layout (one uint16_t): the host glue reinterprets
// tensor data pointers as these types.
#pragma once

#include <cmath>

#include "float16.h"
#include "platform.h"

namespace qwen4exp {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

// The storage type of a kernel's activations, as a runtime tag in params structs.
enum class FloatType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

QWEN4EXP_HD float to_float(float x) { return x; }
QWEN4EXP_HD float to_float(bf16_t x) { return bf16_bits_to_float(x.bits); }
QWEN4EXP_HD float to_float(f16_t x) { return fp16_bits_to_float(x.bits); }

template <typename T>
struct FloatConvert;
template <>
struct FloatConvert<float> {
  QWEN4EXP_HD static float from(float x) { return x; }
};
template <>
struct FloatConvert<bf16_t> {
  QWEN4EXP_HD static bf16_t from(float x) { return bf16_t{float_to_bf16_bits(x)}; }
};
template <>
struct FloatConvert<f16_t> {
  QWEN4EXP_HD static f16_t from(float x) { return f16_t{float_to_fp16_bits(x)}; }
};

// fp32 -> T, round to nearest even (torch's `.to(dtype)`).
template <typename T>
QWEN4EXP_HD T from_float(float x) {
  return FloatConvert<T>::from(x);
}

// x rounded to T and read back: the value an eager graph materialises in T.
template <typename T>
QWEN4EXP_HD float round_to(float x) {
  return to_float(from_float<T>(x));
}

// The fp32 sigmoid as vLLM writes it, 1 / (1 + exp(-x)), on every backend alike: exp in double,
// rounded once to fp32, is the correctly rounded fp32 exp (but for a double-rounding tie, some
// 2^-29 of inputs), where a device expf is off by up to 2 units in the last place. It is what
// makes the GPU's 16-bit ple_conv equal the CPU's bit for bit (tests/test_ple_conv.py checks
// every 16-bit input), with a·b+c never contracted into an FMA (setup.py's device flags).
QWEN4EXP_HD float sigmoid_f32(float x) {
  const float e = static_cast<float>(exp(-static_cast<double>(x)));
  return 1.0f / (1.0f + e);
}

}  // namespace qwen4exp
