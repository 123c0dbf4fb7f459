// One table row converted to the output dtype, for the CPU gathers (gather_rows.cpp's cached
// path and gather_rows_stream.cpp's streaming path): RowConverter<In, Out> and what it runs, fp8
// lookups, NVFP4 decoding and float conversions. Each row's conversion is one call, through a
// pointer RowConverter holds, into a loop compiled for the CPU's instruction set: the float and
// NVFP4 loops are target_clones in row_convert.cpp (the loader picks the clone; RowLoops), the
// fp8 lookups templates here with per-function targets, picked at run time
// (set_cpu_gather_fp8_lookup, in row_convert.cpp). RowConverter itself is inlined into the
// paths' row loops.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "../common/dispatch.h"
#include "../common/gather_rows.h"
#include "simd.h"

namespace qwen4exp::cpu {

// --- fp8 dequantisation ----------------------------------------------------------------------
//
// Every fp8 byte has one possible output (its value times the scale, rounded to the output
// type): the 256 outputs are built with the scalar dequantize, so every path below is
// bit-identical to it by construction, and kept per thread for the last scale (fp8_outputs).
// They are looked up
// - with AVX-512BW, in registers: vpermi2w / vpermi2ps look up 32 (16-bit outputs) or 16 (fp32)
//   bytes per instruction; the 256 entries are 4 (8) slices of 64 (32), one permute per slice,
//   then the upper index bits pick the slice with masked blends;
// - with AVX2 and 16-bit outputs whose table factors (Fp8Outputs::factored, checked for all 256
//   codes), by two 16-entry byte shuffles and a few integer operations per 32 codes;
// - elsewhere, one element at a time from L1 (an 8-byte load of codes, then a load and a store
//   per element).
// Decoding the fields in 8-lane vectors instead (selects for subnormals and NaN, the scale
// product, the output's rounding: ~6 instructions an element) made fp8 rows cost more than bf16
// rows of twice the bytes (docs/design/cpu-kernel-notes.md).

// The outputs of one fp8 format at one scale. For a 16-bit output with kMantissaBits mantissa
// bits, scaling a normal code by 2^k moves its output's exponent field by k as long as the output
// stays normal and finite, and negating a code flips the output's sign bit. So where the scale
// allows, the output of code b, with exponent field e = (b >> 3) & 15 and mantissa m = b & 7, is
//   (base[m + 8·(e != 0)] + (e << kMantissaBits)) ^ ((b & 0x80) << 8)      (16-bit arithmetic)
// except for at most two codes (the NaNs), which `factored` records after checking every code.
template <typename OutT>
constexpr int kMantissaBits = std::is_same_v<OutT, bf16_t> ? 7 : 10;  // 16-bit OutT

template <typename OutT>
struct Fp8Outputs {
  std::array<OutT, 256> value{};
  bool factored = false;
  std::array<uint8_t, 16> base_low{}, base_high{};  // the bytes of base[16]
  std::array<uint16_t, 2> odd_code{256, 256};       // 256: none (no code is)
  std::array<uint16_t, 2> odd_value{};
};

template <typename OutT>
uint16_t factored_output(const uint16_t* base, uint32_t code) {
  const uint32_t e = (code >> 3) & 15u, m = code & 7u;
  const uint16_t sum =
      static_cast<uint16_t>(base[m + (e != 0 ? 8 : 0)] + (e << kMantissaBits<OutT>));
  return static_cast<uint16_t>(sum ^ ((code & 0x80u) << 8));
}

template <typename OutT>
void factor_fp8_outputs(Fp8Outputs<OutT>& t) {
  if constexpr (sizeof(OutT) == 2) {
    uint16_t value[256], base[16];
    std::memcpy(value, t.value.data(), sizeof(value));
    for (int m = 0; m < 8; ++m) {
      base[m] = value[m];
      base[8 + m] = static_cast<uint16_t>(value[8 + m] - (1u << kMantissaBits<OutT>));
    }
    int odd = 0;
    for (uint32_t code = 0; code < 256; ++code) {
      if (factored_output<OutT>(base, code) == value[code]) continue;
      if (odd == 2) return;  // t.factored stays false
      t.odd_code[odd] = static_cast<uint16_t>(code);
      t.odd_value[odd++] = value[code];
    }
    for (int k = 0; k < 16; ++k) {
      t.base_low[k] = static_cast<uint8_t>(base[k]);
      t.base_high[k] = static_cast<uint8_t>(base[k] >> 8);
    }
    t.factored = true;
  }
}

// The outputs of fp8 format In at scale_out (already rounded to Out), rebuilt only when this
// thread's last call with the same formats had another scale (a decode step's call would
// otherwise spend ~1 us on them).
template <Dtype In, Dtype Out>
const Fp8Outputs<storage_t<Out>>& fp8_outputs(float scale_out) {
  struct Cache {
    uint32_t scale_bits = 0;
    bool valid = false;
    Fp8Outputs<storage_t<Out>> outputs;
  };
  thread_local Cache cache;
  uint32_t bits;
  std::memcpy(&bits, &scale_out, sizeof(bits));
  if (!cache.valid || cache.scale_bits != bits) {
    cache.outputs = {};
    for (int b = 0; b < 256; ++b) {
      cache.outputs.value[b] = dequantize<In, Out>(static_cast<uint8_t>(b), scale_out);
    }
    factor_fp8_outputs(cache.outputs);
    cache.scale_bits = bits;
    cache.valid = true;
  }
  return cache.outputs;
}

template <typename OutT>
void fp8_rows_scalar(const uint8_t* __restrict src, OutT* __restrict dst, int64_t n,
                     const Fp8Outputs<OutT>& t) {
  const OutT* __restrict lut = t.value.data();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t codes;
    std::memcpy(&codes, src + i, sizeof(codes));
    for (int k = 0; k < 8; ++k) dst[i + k] = lut[(codes >> (8 * k)) & 0xFFu];
  }
  for (; i < n; ++i) dst[i] = lut[src[i]];
}

#if QWEN4EXP_X86_AVX512  // x86-64 (the macro names where the intrinsics can be compiled)
// A factored table (Fp8Outputs), 32 codes per step; the rest through the scalar lookup.
// kStream: the steps' 32-byte halves go out as streaming stores (the streaming path, `dst`
// 32-byte aligned).
template <bool kStream, typename OutT>
__attribute__((target("avx2"))) void fp8_rows_avx2(const uint8_t* __restrict src,
                                                   OutT* __restrict dst, int64_t n,
                                                   const Fp8Outputs<OutT>& t) {
  static_assert(sizeof(OutT) == 2);
  const auto table16 = [](const std::array<uint8_t, 16>& bytes) __attribute__((target("avx2"))) {
    return _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes.data())));
  };
  const __m256i base_low = table16(t.base_low), base_high = table16(t.base_high);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i exponent_bits = _mm256_set1_epi8(0x78), mantissa_bits = _mm256_set1_epi8(7),
                normal = _mm256_set1_epi8(8);
  const __m256i exponent16 = _mm256_set1_epi16(0x78), sign16 = _mm256_set1_epi16(0x80);
  const __m256i odd_code0 = _mm256_set1_epi16(static_cast<int16_t>(t.odd_code[0])),
                odd_code1 = _mm256_set1_epi16(static_cast<int16_t>(t.odd_code[1])),
                odd_value0 = _mm256_set1_epi16(static_cast<int16_t>(t.odd_value[0])),
                odd_value1 = _mm256_set1_epi16(static_cast<int16_t>(t.odd_value[1]));
  // Eight codes of each 128-bit lane, widened to 16 bits, with their looked-up bases.
  const auto finish = [&](__m256i codes, __m256i base) __attribute__((target("avx2"))) {
    const __m256i exponent =
        _mm256_slli_epi16(_mm256_and_si256(codes, exponent16), kMantissaBits<OutT> - 3);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(codes, sign16), 8);
    __m256i out = _mm256_xor_si256(_mm256_add_epi16(base, exponent), sign);
    out = _mm256_blendv_epi8(out, odd_value0, _mm256_cmpeq_epi16(codes, odd_code0));
    return _mm256_blendv_epi8(out, odd_value1, _mm256_cmpeq_epi16(codes, odd_code1));
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i is_normal =
        _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, exponent_bits), zero), normal);
    const __m256i index = _mm256_or_si256(_mm256_and_si256(x, mantissa_bits), is_normal);
    const __m256i low = _mm256_shuffle_epi8(base_low, index);
    const __m256i high = _mm256_shuffle_epi8(base_high, index);
    // unpacklo/hi work within 128-bit lanes: codes [0, 8) and [16, 24), then [8, 16), [24, 32).
    const __m256i a = finish(_mm256_unpacklo_epi8(x, zero), _mm256_unpacklo_epi8(low, high));
    const __m256i b = finish(_mm256_unpackhi_epi8(x, zero), _mm256_unpackhi_epi8(low, high));
    const __m256i first = _mm256_permute2x128_si256(a, b, 0x20);
    const __m256i second = _mm256_permute2x128_si256(a, b, 0x31);
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), first);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 16), second);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), first);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 16), second);
    }
  }
  if (i < n) fp8_rows_scalar(src + i, dst + i, n - i, t);
}
#endif  // QWEN4EXP_X86_AVX512

#if QWEN4EXP_X86_AVX512
#define QWEN4EXP_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))

// 16-bit outputs (Half: bf16_t or f16_t, whose bits the table holds): 32 bytes per step.
// kStream: each step's 64 bytes go out as one streaming store (the streaming path, `dst`
// 64-byte aligned), the tail with an ordinary one.
template <bool kStream, typename Half>
QWEN4EXP_AVX512BW void lut_rows_avx512(const uint8_t* __restrict src, Half* __restrict dst,
                                       int64_t n, const Half* __restrict lut) {
  static_assert(sizeof(Half) == 2);
  __m512i t[8];
  for (int k = 0; k < 8; ++k) t[k] = _mm512_loadu_si512(lut + 32 * k);
  const __m512i bit6 = _mm512_set1_epi16(0x40), bit7 = _mm512_set1_epi16(0x80);
  auto lookup = [&](__m512i idx) QWEN4EXP_AVX512BW {
    const __mmask32 hi6 = _mm512_test_epi16_mask(idx, bit6);
    const __m512i low = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[0], idx, t[1]),
                                                _mm512_permutex2var_epi16(t[2], idx, t[3]));
    const __m512i high = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[4], idx, t[5]),
                                                 _mm512_permutex2var_epi16(t[6], idx, t[7]));
    return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(idx, bit7), low, high);
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512i idx = _mm512_cvtepu8_epi16(bytes);
    if constexpr (kStream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), lookup(idx));
    } else {
      _mm512_storeu_si512(dst + i, lookup(idx));
    }
  }
  if (i < n) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1);
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(tail, src + i));
    _mm512_mask_storeu_epi16(dst + i, tail, lookup(idx));
  }
}

// fp32 outputs: 16 bytes per step.
template <bool kStream>
QWEN4EXP_AVX512BW void lut_rows_avx512(const uint8_t* __restrict src, float* __restrict dst,
                                       int64_t n, const float* __restrict lut) {
  // The zero-masking widen with an all-ones mask is the plain widen; the unmasked intrinsic
  // trips GCC 12's -Wmaybe-uninitialized on its internal undefined operand.
  constexpr __mmask16 kAll16 = 0xFFFF;
  __m512 t[16];
  for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(lut + 16 * k);
  const __m512i bit5 = _mm512_set1_epi32(0x20), bit6 = _mm512_set1_epi32(0x40),
                bit7 = _mm512_set1_epi32(0x80);
  auto lookup = [&](__m512i idx) QWEN4EXP_AVX512BW {
    const __mmask16 hi5 = _mm512_test_epi32_mask(idx, bit5);
    __m512 r[4];
    for (int k = 0; k < 4; ++k) {
      r[k] = _mm512_mask_blend_ps(hi5, _mm512_permutex2var_ps(t[4 * k], idx, t[4 * k + 1]),
                                  _mm512_permutex2var_ps(t[4 * k + 2], idx, t[4 * k + 3]));
    }
    const __mmask16 hi6 = _mm512_test_epi32_mask(idx, bit6);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, bit7),
                                _mm512_mask_blend_ps(hi6, r[0], r[1]),
                                _mm512_mask_blend_ps(hi6, r[2], r[3]));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m512i idx = _mm512_maskz_cvtepu8_epi32(kAll16, bytes);
    if constexpr (kStream) {
      _mm512_stream_ps(dst + i, lookup(idx));
    } else {
      _mm512_storeu_ps(dst + i, lookup(idx));
    }
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i idx = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_maskz_loadu_epi8(tail, src + i));
    _mm512_mask_storeu_ps(dst + i, tail, lookup(idx));
  }
}
#endif  // QWEN4EXP_X86_AVX512

// --- Other conversions (fp32 / bf16 / fp16 to one another) ----------------------------------
//
// Eight lanes at a time on simd.h's vectors, compiled for AVX-512, AVX2 and baseline x86-64 and
// picked by the loader (target_clones): the same integer round-to-nearest-even as the scalar
// encode, so the same bits. One lane at a time, the fp16 conversions (subnormals, overflow to
// inf) cost several times a plain row copy.
// (The loops are in row_convert.cpp: RowLoops.)

// --- NVFP4 ----------------------------------------------------------------------------------
//
// Decoded lane by lane in simd.h's vectors (so in AVX-512, AVX2 or baseline clones): eight codes
// are one 32-bit word of the row shifted by 0, 4, ..., 28 (element 2k is the low nibble of byte
// k, so element j sits at bit 4j of the little-endian word), their fp32 bits come from
// e2m1_to_float_bits' formula, then the two multiplications of nvfp4_value and the output's
// rounding. `n` is a multiple of kNvfp4Block (the host checks d; staged chunks keep it).
// The 8 code bytes of a block are one 64-bit load and each block scale a lookup in
// `scale_values` (the 256 e4m3fn values): assembling the words byte by byte, and decoding the
// scales with fp8_e4m3fn_to_float's branches, made the decode about three times slower.
// (The loops are in row_convert.cpp: RowLoops.)

// The 256 float8_e4m3fn values, decoded once per process.
const float* e4m3fn_values();

// The float and NVFP4 row loops, by address. They are target_clones (compiled for AVX-512, AVX2
// and baseline x86-64; the loader picks one), defined with internal linkage in row_convert.cpp:
// GCC exports a target_clones function of external linkage from a shared library whatever its
// visibility, and the CMake library exports its entry points only (tools/check-cmake.sh). A call
// through one of these pointers costs what a direct call to the clone did, an indirect jump.
struct RowLoops {
  void (*f32_bf16)(const float*, bf16_t*, int64_t);
  void (*f32_f16)(const float*, f16_t*, int64_t);
  void (*bf16_f32)(const bf16_t*, float*, int64_t);
  void (*bf16_f16)(const bf16_t*, f16_t*, int64_t);
  void (*f16_f32)(const f16_t*, float*, int64_t);
  void (*f16_bf16)(const f16_t*, bf16_t*, int64_t);
  // (src, its block scales, dst, n, the global scale, e4m3fn_values())
  void (*nvfp4_f32)(const uint8_t*, const uint8_t*, float*, int64_t, float, const float*);
  void (*nvfp4_bf16)(const uint8_t*, const uint8_t*, bf16_t*, int64_t, float, const float*);
  void (*nvfp4_f16)(const uint8_t*, const uint8_t*, f16_t*, int64_t, float, const float*);
};
const RowLoops& row_loops();

// The loop of RowLoops that converts In rows to Out (In: fp32, bf16, fp16 or NVFP4).
template <Dtype In, Dtype Out>
auto row_loop(const RowLoops& l) {
  if constexpr (In == Dtype::kF32 && Out == Dtype::kBF16) return l.f32_bf16;
  if constexpr (In == Dtype::kF32 && Out == Dtype::kF16) return l.f32_f16;
  if constexpr (In == Dtype::kBF16 && Out == Dtype::kF32) return l.bf16_f32;
  if constexpr (In == Dtype::kBF16 && Out == Dtype::kF16) return l.bf16_f16;
  if constexpr (In == Dtype::kF16 && Out == Dtype::kF32) return l.f16_f32;
  if constexpr (In == Dtype::kF16 && Out == Dtype::kBF16) return l.f16_bf16;
  if constexpr (In == Dtype::kNvfp4 && Out == Dtype::kF32) return l.nvfp4_f32;
  if constexpr (In == Dtype::kNvfp4 && Out == Dtype::kBF16) return l.nvfp4_bf16;
  if constexpr (In == Dtype::kNvfp4 && Out == Dtype::kF16) return l.nvfp4_f16;
}

// Converts `width` elements of one table row; `scales` is the row's NVFP4 block scales (unused,
// and null, for other formats). An NVFP4 `src` may start at any multiple of kNvfp4Block elements.
template <Dtype In, Dtype Out>
struct RowConverter {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  // fp8 only: the outputs of every code (fp8_outputs), and the lookup over them.
  const Fp8Outputs<OutT>* fp8 = nullptr;
  void (*fp8_rows)(const uint8_t*, OutT*, int64_t, const Fp8Outputs<OutT>&) = nullptr;
  // fp8 with a vector lookup only (else null): the same lookup, written with streaming stores to
  // a `dst` aligned to fp8_stream_align bytes: the streaming path's rows need no stage to be
  // streamed from.
  void (*fp8_rows_stream)(const uint8_t*, OutT*, int64_t, const Fp8Outputs<OutT>&) = nullptr;
  uintptr_t fp8_stream_align = 0;
  float global_scale = 0.0f;            // NVFP4 only
  const float* scale_values = nullptr;  // NVFP4 only: e4m3fn_values()
  // fp32/bf16/fp16 and NVFP4 rows to another dtype only (else null): the loop of row_loops().
  using Loop = decltype(row_loop<In, Out>(std::declval<const RowLoops&>()));
  std::conditional_t<std::is_void_v<Loop>, std::nullptr_t, Loop> loop = nullptr;

  explicit RowConverter(const GatherRowsParams& p) {
    if constexpr (!std::is_void_v<Loop>) loop = row_loop<In, Out>(row_loops());
    if constexpr (In == Dtype::kNvfp4) {
      global_scale = *p.scale;
      scale_values = e4m3fn_values();
    }
    if constexpr (is_fp8(In)) {
      fp8 = &fp8_outputs<In, Out>(round_scale<Out>(*p.scale));
      fp8_rows = &fp8_rows_scalar<OutT>;
#if QWEN4EXP_X86_AVX512
      const int64_t lookup = cpu_gather_fp8_lookup();
      if (lookup == kFp8LookupAvx512) {
        fp8_rows = [](const uint8_t* src, OutT* dst, int64_t n, const Fp8Outputs<OutT>& t) {
          lut_rows_avx512<false>(src, dst, n, t.value.data());
        };
        fp8_rows_stream = [](const uint8_t* src, OutT* dst, int64_t n, const Fp8Outputs<OutT>& t) {
          lut_rows_avx512<true>(src, dst, n, t.value.data());
        };
        fp8_stream_align = 64;
      } else if constexpr (sizeof(OutT) == 2) {
        if (fp8->factored && lookup == kFp8LookupAvx2) {
          fp8_rows = &fp8_rows_avx2<false, OutT>;
          fp8_rows_stream = &fp8_rows_avx2<true, OutT>;
          fp8_stream_align = 32;
        }
      }
#endif
    }
  }

  // Same-dtype rows are copied, never converted (copy_block, and write_row on the streaming
  // path).
  void operator()(const InT* __restrict src, [[maybe_unused]] const uint8_t* __restrict scales,
                  OutT* __restrict dst, int64_t width) const {
    static_assert(In != Out, "same-dtype rows are copied, not converted");
    if constexpr (In == Dtype::kNvfp4) {
      loop(src, scales, dst, width, global_scale, scale_values);
    } else if constexpr (is_fp8(In)) {
      fp8_rows(src, dst, width, *fp8);
    } else {
      loop(src, dst, width);
    }
  }
};

// Calls f(in, out) with the dtype tags of p's table and output (decltype(in)::kDtype, ...), or
// throws for a pair the CPU gather has no kernel for: the one dispatch of both of its paths.
template <typename F>
void dispatch_gather_dtypes(const GatherRowsParams& p, F&& f) {
  const auto unsupported = [] {
    throw std::invalid_argument("gather_rows: no CPU kernel for this table and output dtype");
  };
  dispatch_dtype(
      kTableDtypes, p.table_dtype,
      [&](auto in) {
        dispatch_dtype(kFloatDtypes, p.out_dtype, [&](auto out) { f(in, out); }, unsupported);
      },
      unsupported);
}

}  // namespace qwen4exp::cpu
