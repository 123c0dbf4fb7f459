// The kernels' element types, one system for every op: the Dtype tag params structs carry, the
// storage type of each (bf16_t and f16_t wrap the bit patterns of float16.h, so one kernel
// template serves fp32, bf16 and fp16 through to_float / from_float), and the conversions.
// c10::BFloat16 and c10::Half have the same layout (one uint16_t): the host glue reinterprets
// tensor data pointers as these types. fp8 and NVFP4 decoding is fp8.h; dtype -> template
// dispatch is dispatch.h.
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

// Element formats, as a runtime tag in params structs. Activations (ple_gate, ple_conv) and
// gather outputs are kF32, kBF16 or kF16; gather tables may be any. kNvfp4 is vLLM's packed
// layout: uint8 rows of d/2 bytes (element 2k in the low nibble of byte k, 2k+1 in the high
// one) with one float8_e4m3fn scale per kNvfp4Block elements and a global fp32 scale.
enum class Dtype : int32_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kFp8E4M3FN = 3,
  kFp8E4M3FNUZ = 4,
  kNvfp4 = 5,
};

// The storage word of each format (an NVFP4 byte holds two elements).
template <Dtype D>
struct StorageOf {
  using type = uint8_t;  // fp8 and NVFP4
};
template <>
struct StorageOf<Dtype::kF32> {
  using type = float;
};
template <>
struct StorageOf<Dtype::kBF16> {
  using type = bf16_t;
};
template <>
struct StorageOf<Dtype::kF16> {
  using type = f16_t;
};
template <Dtype D>
using storage_t = typename StorageOf<D>::type;

// The formats of activations and of gather outputs.
constexpr bool is_float_dtype(Dtype t) {
  return t == Dtype::kF32 || t == Dtype::kBF16 || t == Dtype::kF16;
}

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
// makes the GPU's 16-bit ple_conv equal the CPU's bit for bit (tests/ple_conv/ checks
// every 16-bit input), with a·b+c never contracted into an FMA (setup.py's device flags).
QWEN4EXP_HD float sigmoid_f32(float x) {
  const float e = static_cast<float>(exp(-static_cast<double>(x)));
  return 1.0f / (1.0f + e);
}

}  // namespace qwen4exp
