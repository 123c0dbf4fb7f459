// FP8 e4m3 and NVFP4 (E2M1) decoding on raw bits, host and device, and the element conversions of
// gather_rows.
//
// Two e4m3 formats exist and both ship: e4m3fn (OCP; bias 7, no inf, S.1111.111 is NaN, used on
// NVIDIA and MI350) and e4m3fnuz (bias 8, no inf, no -0, 0x80 is the only NaN, used on MI300).
// Decoding is exact in fp32, so our fp32 value equals torch's `fp8.to(torch.float32)`. Neither
// hip_fp8.h (absent from ROCm 5.2) nor cuda_fp8.h is needed.
#pragma once

#include "float_types.h"
#include "platform.h"

namespace qwen4exp {

QWEN4EXP_HD float fp8_e4m3fn_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xFu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0) {  // subnormal: m·2^-9, exact and normal in fp32
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;
    return bits_to_float(float_to_bits(magnitude) | sign);
  }
  if (exponent == 0xF && mantissa == 0x7) return bits_to_float(sign | 0x7FC00000u);
  return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

QWEN4EXP_HD float fp8_e4m3fnuz_to_float(uint8_t b) {
  if (b == 0x80u) return bits_to_float(0x7FC00000u);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xFu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0) {  // subnormal: m·2^-10
    const float magnitude = static_cast<float>(mantissa) * 0.0009765625f;
    return bits_to_float(float_to_bits(magnitude) | sign);
  }
  return bits_to_float(sign | ((exponent + 119u) << 23) | (mantissa << 20));
}

// NVFP4 E2M1 code (bit 3 sign, bits 0-2 the magnitude index) as fp32 bits: magnitudes 0, 0.5,
// 1, 1.5, 2, 3, 4, 6. From index 2 on, 0x3F000000 + (m << 22) is the fp32 pattern (exponent and
// one mantissa bit step together); 1 (0.5) and 0 are the exceptions. Code 8 is -0.
QWEN4EXP_HD uint32_t e2m1_to_float_bits(uint32_t code) {
  const uint32_t m = code & 7u;
  const uint32_t magnitude = m >= 2u ? 0x3F000000u + (m << 22) : (m == 1u ? 0x3F000000u : 0u);
  return magnitude | ((code & 8u) << 28);
}

// Elements of an NVFP4 row per block scale.
constexpr int kNvfp4Block = 16;

constexpr bool is_fp8(Dtype t) { return t == Dtype::kFp8E4M3FN || t == Dtype::kFp8E4M3FNUZ; }

// Table elements per storage word (an NVFP4 byte holds two).
constexpr int elems_per_word(Dtype t) { return t == Dtype::kNvfp4 ? 2 : 1; }

// One element as fp32 (exact for every format).
template <Dtype T>
QWEN4EXP_HD float decode(storage_t<T> x) {
  static_assert(T != Dtype::kNvfp4, "an NVFP4 byte is two elements: use nvfp4_value");
  if constexpr (T == Dtype::kFp8E4M3FN) {
    return fp8_e4m3fn_to_float(x);
  } else if constexpr (T == Dtype::kFp8E4M3FNUZ) {
    return fp8_e4m3fnuz_to_float(x);
  } else {
    return to_float(x);
  }
}

// Rounds an fp32 value into an output format (fp32, bf16 or fp16), as torch's `.to()` does.
template <Dtype T>
QWEN4EXP_HD storage_t<T> encode(float f) {
  static_assert(is_float_dtype(T), "gather_rows writes fp32, bf16 or fp16 only");
  return from_float<storage_t<T>>(f);
}

// One element of an fp8 table in the output format: vLLM's eager `row.to(out) * scale.to(out)`.
// The fp8 value is exact in every output format (4 significant bits, exponents within range), so
// that product is round_out(float(x) · float(scale_out)); the fp32 product itself is exact for
// bf16/fp16 scales (4 + 11 significant bits), and is what torch computes for an fp32 output.
template <Dtype In, Dtype Out>
QWEN4EXP_HD storage_t<Out> dequantize(uint8_t x, float scale_out) {
  return encode<Out>(decode<In>(x) * scale_out);
}

// NVFP4 element = fp32(e2m1 · block scale) · global scale, rounded once in fp32, as vLLM 0.33.0's
// Triton lookup computes it (the first product is exact: 2 by 4 significant bits, exponents far
// inside fp32's range). Two separate multiplications, in this order: the compilers keep them
// apart (no a·b·c reassociation without fast-math, nothing to contract into an FMA).
QWEN4EXP_HD float nvfp4_value(uint32_t code, float block_scale, float global_scale) {
  return (bits_to_float(e2m1_to_float_bits(code)) * block_scale) * global_scale;
}

// The per-tensor scale as torch rounds it to the output dtype, back in fp32.
template <Dtype Out>
QWEN4EXP_HD float round_scale(float scale) {
  return decode<Out>(encode<Out>(scale));
}

}  // namespace qwen4exp
