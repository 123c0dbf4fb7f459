// CPU kernel for gather_rows (SPEC §4).
//
// A random row of a table far larger than the caches is a DRAM miss (and usually a TLB miss): the
// gather is latency-bound, not bandwidth-bound. So each worker walks its (token, head) items in
// order and, kPrefetchDistance items ahead, issues software prefetches for every cache line of the
// row it will need: that keeps many misses in flight per core instead of one row at a time, which
// is what F.embedding / index_select do. The rows themselves are then plain copies (same dtype),
// lookups in a table of the 256 already-scaled, already-rounded fp8 outputs (in registers with
// AVX-512BW, factored into byte shuffles with AVX2), a vectorised decode of two E2M1 codes per
// byte with the row's block scales (NVFP4), or a vectorised decode/round loop (other
// conversions). All offsets are int64:
// the released table holds 51.2 billion elements.
//
// An output larger than this process's threads can keep in cache (a prefill) takes the
// streaming path instead, where the CPU has AVX: see "The streaming path" below.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/dispatch.h"
#include "../common/gather_rows.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

// Items (rows) looked ahead. One row of the released table is 320 bytes (bf16) = 5 lines, so 16
// rows keep ~80 line fills outstanding per core: enough to cover DRAM + page-walk latency while
// staying well inside L1/L2 (what is prefetched is consumed a few hundred ns later). A prefetch
// that misses the TLB holds retirement until its page walk ends, so the reorder buffer, not the
// distance, bounds the walks in flight: sorting by address (the streaming path) is what makes
// walks cheaper (docs/design/cpu-kernel-notes.md).
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

// always_inline is load-bearing: GCC's IPA treats __builtin_prefetch as free of side effects,
// so a helper that only prefetches is classified "const" and every call to it is deleted as dead
// code (GCC 12 -O3 drops them all). Inlined, the prefetches stay in the loop.
// Locality 3 (prefetcht0: into L1 and below), as the row is copied a few hundred ns later:
// faster than prefetcht1 and prefetchnta on every id pattern measured
// (docs/design/cpu-kernel-notes.md).
__attribute__((always_inline)) inline void prefetch_bytes(const char* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(begin + bytes - 1);
  for (uintptr_t line = first; line <= last; line += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
  }
}

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
template <typename InV, typename OutV>
QWEN4EXP_ALWAYS_INLINE void convert_rows_body(const InV* src, OutV* dst, int64_t n) {
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) simd::store(dst + i, simd::load(src + i));
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    simd::store_n(dst + i, simd::load_n(src + i, rest), rest);
  }
}

#define QWEN4EXP_CONVERT_ROWS(NAME, IN, OUT)                          \
  QWEN4EXP_CPU_CLONES void NAME(const IN* src, OUT* dst, int64_t n) { \
    convert_rows_body(src, dst, n);                                   \
  }
QWEN4EXP_CONVERT_ROWS(convert_f32_bf16, float, bf16_t)
QWEN4EXP_CONVERT_ROWS(convert_f32_f16, float, f16_t)
QWEN4EXP_CONVERT_ROWS(convert_bf16_f32, bf16_t, float)
QWEN4EXP_CONVERT_ROWS(convert_bf16_f16, bf16_t, f16_t)
QWEN4EXP_CONVERT_ROWS(convert_f16_f32, f16_t, float)
QWEN4EXP_CONVERT_ROWS(convert_f16_bf16, f16_t, bf16_t)
#undef QWEN4EXP_CONVERT_ROWS

template <Dtype In, Dtype Out>
void convert_rows(const storage_t<In>* src, storage_t<Out>* dst, int64_t n) {
  if constexpr (In == Dtype::kF32 && Out == Dtype::kBF16) convert_f32_bf16(src, dst, n);
  if constexpr (In == Dtype::kF32 && Out == Dtype::kF16) convert_f32_f16(src, dst, n);
  if constexpr (In == Dtype::kBF16 && Out == Dtype::kF32) convert_bf16_f32(src, dst, n);
  if constexpr (In == Dtype::kBF16 && Out == Dtype::kF16) convert_bf16_f16(src, dst, n);
  if constexpr (In == Dtype::kF16 && Out == Dtype::kF32) convert_f16_f32(src, dst, n);
  if constexpr (In == Dtype::kF16 && Out == Dtype::kBF16) convert_f16_bf16(src, dst, n);
}

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
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the NVFP4 decode reads LE words");

template <typename OutV>
QWEN4EXP_ALWAYS_INLINE void nvfp4_rows_body(const uint8_t* __restrict src,
                                            const uint8_t* __restrict scales, OutV* __restrict dst,
                                            int64_t n, float global_scale,
                                            const float* __restrict scale_values) {
  using simd::u32x8;
  const u32x8 shifts = {0, 4, 8, 12, 16, 20, 24, 28};
  const simd::f32x8 global = simd::splat(global_scale);
  for (int64_t block = 0; block < n / kNvfp4Block; ++block) {
    const simd::f32x8 block_scale = simd::splat(scale_values[scales[block]]);
    uint64_t packed;  // little-endian: byte k at bits 8k (asserted below)
    std::memcpy(&packed, src + block * (kNvfp4Block / 2), sizeof(packed));
    for (int half = 0; half < 2; ++half) {
      const uint32_t word = static_cast<uint32_t>(packed >> (32 * half));
      const u32x8 codes = (simd::splat_u(word) >> shifts) & 0xFu;
      const u32x8 m = codes & 7u;
      const u32x8 magnitude = m >= 2u ? 0x3F000000u + (m << 22)
                                      : (m == 1u ? simd::splat_u(0x3F000000u) : 0u);
      const simd::f32x8 e2m1 = simd::as_f32(magnitude | ((codes & 8u) << 28));
      simd::store(dst + block * kNvfp4Block + half * 8, (e2m1 * block_scale) * global);
    }
  }
}

#define QWEN4EXP_NVFP4_ROWS(NAME, OUT)                                                          \
  QWEN4EXP_CPU_CLONES void NAME(const uint8_t* src, const uint8_t* scales, OUT* dst, int64_t n, \
                                float global_scale, const float* scale_values) {                \
    nvfp4_rows_body(src, scales, dst, n, global_scale, scale_values);                           \
  }
QWEN4EXP_NVFP4_ROWS(nvfp4_rows_f32, float)
QWEN4EXP_NVFP4_ROWS(nvfp4_rows_bf16, bf16_t)
QWEN4EXP_NVFP4_ROWS(nvfp4_rows_f16, f16_t)
#undef QWEN4EXP_NVFP4_ROWS

// The 256 float8_e4m3fn values, decoded once per process.
const float* e4m3fn_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[b] = fp8_e4m3fn_to_float(static_cast<uint8_t>(b));
    return v;
  }();
  return values.data();
}

template <Dtype Out>
void nvfp4_rows(const uint8_t* src, const uint8_t* scales, storage_t<Out>* dst, int64_t n,
                float global_scale, const float* scale_values) {
  const float g = global_scale;
  if constexpr (Out == Dtype::kF32) nvfp4_rows_f32(src, scales, dst, n, g, scale_values);
  if constexpr (Out == Dtype::kBF16) nvfp4_rows_bf16(src, scales, dst, n, g, scale_values);
  if constexpr (Out == Dtype::kF16) nvfp4_rows_f16(src, scales, dst, n, g, scale_values);
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

  explicit RowConverter(const GatherRowsParams& p) {
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
      nvfp4_rows<Out>(src, scales, dst, width, global_scale, scale_values);
    } else if constexpr (is_fp8(In)) {
      fp8_rows(src, dst, width, *fp8);
    } else {
      convert_rows<In, Out>(src, dst, width);
    }
  }
};

// What one thread of this process can count on keeping in cache: its core's L2 plus its share
// of the L3, from sysfs (cpu0's caches; sizes like "32768K"). The L3 share is the L3 over the
// CPUs that sysfs says share it, capped at kL3ShareCap: inside a VM sysfs lists only the VM's
// own CPUs next to the whole socket's L3 (a 2-CPU VM on a 480 MiB-L3 Xeon sees 240 MiB each),
// and the tenants on the other cores use the rest. (sysconf(_SC_LEVEL3_CACHE_SIZE) is no
// substitute: on EPYC it reports every CCD's L3 together.)
// 4 MiB: the L3 per core of a Zen 4 CCD, more than a Xeon gives a core (V-Cache parts have more).
constexpr int64_t kL3ShareCap = int64_t{4} << 20;
struct CacheShare {
  int64_t l2 = int64_t{1} << 20;  // per core, where sysfs has nothing
  int64_t l3 = int64_t{2} << 20;  // per CPU
};

int64_t sysfs_cache_bytes(const std::string& size) {
  int64_t value = std::strtoll(size.c_str(), nullptr, 10);
  const char unit = size.empty() ? '\0' : size.back();
  if (unit == 'K') value <<= 10;
  if (unit == 'M') value <<= 20;
  return value;
}

// CPUs in a sysfs list such as "0-3,8-11".
int64_t sysfs_cpu_count(const std::string& list) {
  int64_t count = 0;
  const char* p = list.c_str();
  while (*p != '\0') {
    char* end = nullptr;
    const long first = std::strtol(p, &end, 10);
    if (end == p) break;
    long last = first;
    p = end;
    if (*p == '-') {
      last = std::strtol(p + 1, &end, 10);
      p = end;
    }
    count += std::max<long>(0, last - first + 1);
    if (*p == ',') ++p;
  }
  return count;
}

const CacheShare& cache_share() {
  static const CacheShare share = [] {
    CacheShare s;
    for (int index = 0; index < 8; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
      std::ifstream level_file(dir + "/level"), size_file(dir + "/size"), type_file(dir + "/type"),
          shared_file(dir + "/shared_cpu_list");
      int level = 0;
      std::string size, type, shared;
      if (!(level_file >> level) || !(size_file >> size) || !(type_file >> type)) continue;
      if (type == "Instruction") continue;
      const int64_t bytes = sysfs_cache_bytes(size);
      if (bytes <= 0) continue;
      const int64_t sharing =
          (shared_file >> shared) ? std::max<int64_t>(1, sysfs_cpu_count(shared)) : 1;
      if (level == 2) s.l2 = bytes / sharing;
      if (level == 3) s.l3 = std::min(kL3ShareCap, bytes / sharing);
    }
    return s;
  }();
  return share;
}

// --- The streaming path --------------------------------------------------------------------
//
// An output larger than what this process's threads can keep in cache (a prefill) would have
// its lines read from DRAM before being overwritten (read-for-ownership) and evicted again before
// anyone reads them: streaming (non-temporal) stores write whole lines straight to memory
// instead, a third less DRAM traffic; 64-byte stores with AVX-512, 32-byte ones with AVX
// (x86-64 CPUs without AVX, and other architectures, keep the cached path).
// Each block of items is also counting-sorted by table row first and copied in table order: the
// row reads sweep the table upwards, consecutive rows share page-table lines and DRAM pages, and
// the page walk that every random row of a multi-GB table costs gets cheaper. That pays with
// either store width: on a Zen 3 EPYC (AVX2, 32-byte stores) the sorted copy took 0.84-0.91x
// the time of the copy in output order, side by side (docs/design/cpu-kernel-notes.md).

// Items per block: the more a block holds, the denser its sorted rows lie in the table (32768
// rows spread over a 4M-row table put one every ~40 KiB, 65536 one every ~20 KiB) and the more
// page-table lines each walk shares with the next. The sort's scratch (kStreamScratchBytes an
// item) should stay in the core's L2, which bounds a block; one block per thread, down to 1024
// items, so that a many-core host still puts every core to work. (On a 2-core Zen 5 VM, 1 MiB
// L2: 65536-item blocks 1.61x index_select at T = 8192, 32768-item ones 1.36x, 131072 1.39x.)
constexpr int64_t kStreamScratchBytes = sizeof(int64_t) + 2 * sizeof(int32_t);
constexpr int64_t kStreamMinBlockItems = 1024;
// Conversions are staged through an L1-resident buffer of this many bytes, then written out.
constexpr int64_t kStageBytes = 2048;
// A converting gather copies its rows as stored, this many bytes of them at a time, before
// converting them (convert_staged): with the kStageBytes, well inside a 32 KiB L1.
constexpr int64_t kRawStageBytes = 16384;

// How the streaming path writes rows: streaming stores 32 or 64 bytes wide (plain ones where the
// CPU has neither).
enum class RowStores { kPlain, kStream32, kStream64 };

// n bytes at dst from src, or zeros with kZeros (src then unused, may be null).
template <bool kZeros>
__attribute__((always_inline)) inline void plain_bytes(char* dst, const char* src, int64_t n) {
  if (n <= 0) return;
  if constexpr (kZeros) {
    std::memset(dst, 0, static_cast<size_t>(n));
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n));
  }
}

#if QWEN4EXP_X86_AVX512  // x86-64: the streaming stores, each compiled for its instruction set

// Writing `bytes` at `dst` with kWide-byte streaming stores: whole aligned pieces [head, end)
// streamed, the unaligned head [0, head) and tail [end, bytes) (if any) written with ordinary
// stores.
template <int kWide>
struct StreamSplit {
  int64_t head, end;
  StreamSplit(const char* dst, int64_t bytes) {
    head = std::min<int64_t>(bytes,
                             static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & (kWide - 1)));
    end = head + (bytes - head) / kWide * kWide;
  }
};

// `bytes` at `dst`, copied from `src` (or zeros, with kZeros; `src` is then unused, may be
// null), `src` unaligned or not. One row per call, not inlined into the copy loop (whose
// instruction set is the baseline's): a call costs a few ns against the tens of a cold
// 320-byte row.
template <bool kZeros>
__attribute__((target("avx512f"))) void stream_row64(char* dst, const char* src, int64_t bytes) {
  const StreamSplit<64> split(dst, bytes);
  plain_bytes<kZeros>(dst, src, split.head);
  for (int64_t i = split.head; i < split.end; i += 64) {
    const __m512i v = kZeros ? _mm512_setzero_si512() : _mm512_loadu_si512(src + i);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), v);
  }
  plain_bytes<kZeros>(dst + split.end, kZeros ? nullptr : src + split.end, bytes - split.end);
}

template <bool kZeros>
__attribute__((target("avx"))) void stream_row32(char* dst, const char* src, int64_t bytes) {
  const StreamSplit<32> split(dst, bytes);
  plain_bytes<kZeros>(dst, src, split.head);
  for (int64_t i = split.head; i < split.end; i += 32) {
    const __m256i v = kZeros ? _mm256_setzero_si256()
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
  }
  plain_bytes<kZeros>(dst + split.end, kZeros ? nullptr : src + split.end, bytes - split.end);
}
#endif  // QWEN4EXP_X86_AVX512

// The widest streaming stores this CPU has.
RowStores best_row_stores() {
#if QWEN4EXP_X86_AVX512
  if (simd::cpu_has_avx512f()) return RowStores::kStream64;
  if (simd::cpu_has_avx()) return RowStores::kStream32;
#endif
  return RowStores::kPlain;
}

// `bytes` at `dst` from `src`, or zeros with kZeros.
template <bool kZeros>
__attribute__((always_inline)) inline void write_row(RowStores stores, char* dst, const char* src,
                                                     int64_t bytes) {
#if QWEN4EXP_X86_AVX512
  if (stores == RowStores::kStream64) return stream_row64<kZeros>(dst, src, bytes);
  if (stores == RowStores::kStream32) return stream_row32<kZeros>(dst, src, bytes);
#endif
  plain_bytes<kZeros>(dst, src, bytes);
}

// A worker's sort buffers, kept across calls (no page faults on 0.5 MiB per block).
struct StreamScratch {
  std::vector<int64_t> row_of;       // [block] table row of each item, -1: a zero row
  std::vector<int32_t> order;        // [block] the owned items, by table row bucket
  std::vector<int32_t> bucket_next;  // [buckets + 1] counting-sort offsets
  std::vector<char> raw;             // converting gathers: a chunk of rows as they are stored
};

StreamScratch& stream_scratch() {
  thread_local StreamScratch scratch;
  return scratch;
}

// The converting gathers of both paths. A converted row costs several times the instructions of
// a copied one, and while a prefetch waits for its page walk the reorder buffer then holds fewer
// rows, so fewer misses overlap (fp8 rows, half the bytes, took 1.5x the time of bf16 ones). So
// items [0, count) go in chunks of kRawStageBytes: a chunk's rows are first copied as they are
// stored (each followed by its NVFP4 block scales, scale_bytes of them) into this thread's
// L1-resident buffer, in a loop as lean as the same-dtype copy, prefetching
// prefetch(j + kPrefetchDistance) as it goes; then emit(j, row, scales) converts each from
// there. source(j) gives item j's row and scales as stored; a null row is a zero row, which is
// not staged and reaches emit as a null row.
template <typename Source, typename Prefetch, typename Emit>
__attribute__((always_inline)) inline void convert_staged(int64_t count, int64_t row_bytes,
                                                          int64_t scale_bytes, Source source,
                                                          Prefetch prefetch, Emit emit) {
  const int64_t raw_bytes = row_bytes + scale_bytes;
  const int64_t chunk_rows = std::max<int64_t>(1, kRawStageBytes / raw_bytes);
  std::vector<char>& raw = stream_scratch().raw;
  raw.resize(static_cast<size_t>(chunk_rows * raw_bytes));
  for (int64_t j0 = 0; j0 < count; j0 += chunk_rows) {
    const int64_t end = std::min(count, j0 + chunk_rows);
    for (int64_t j = j0; j < end; ++j) {
      if (j + kPrefetchDistance < count) prefetch(j + kPrefetchDistance);
      const auto [row, scales] = source(j);
      if (row == nullptr) continue;
      char* staged = raw.data() + (j - j0) * raw_bytes;
      std::memcpy(staged, row, static_cast<size_t>(row_bytes));
      if (scale_bytes > 0)
        std::memcpy(staged + row_bytes, scales, static_cast<size_t>(scale_bytes));
    }
    for (int64_t j = j0; j < end; ++j) {
      const char* staged = raw.data() + (j - j0) * raw_bytes;
      const bool zero = source(j).first == nullptr;
      emit(j, zero ? nullptr : staged,
           reinterpret_cast<const uint8_t*>(zero ? nullptr : staged + row_bytes));
    }
  }
}

template <Dtype In, Dtype Out>
struct StreamJob {
  GatherRowsParams p;
  const RowConverter<In, Out>* convert;
  RowStores stores;
  int64_t items, block_items, blocks, shift, buckets;
  int64_t cache_bytes;  // what one thread can keep in cache (cpu_gather_stream_bytes / threads)
};

// One block of items.
template <Dtype In, Dtype Out>
void stream_block(const StreamJob<In, Out>& job, int64_t block) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const GatherRowsParams& q = job.p;
  const RowStores stores = job.stores;
  const char* const table = static_cast<const char*>(q.table);
  char* const output = static_cast<char*>(q.output);
  const int64_t nh = q.num_heads;
  const int64_t width = q.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT)) / elems_per_word(In);
  const int64_t out_row_bytes = width * static_cast<int64_t>(sizeof(OutT));
  const int64_t table_row_bytes = q.table_row_stride * static_cast<int64_t>(sizeof(InT));
  const int64_t out_token_bytes = q.output_row_stride * static_cast<int64_t>(sizeof(OutT));
  const bool dense_output = q.output_row_stride == nh * width;
  const int shift = static_cast<int>(job.shift);
  StreamScratch& s = stream_scratch();
  s.row_of.resize(static_cast<size_t>(job.block_items));
  s.order.resize(static_cast<size_t>(job.block_items));
  s.bucket_next.resize(static_cast<size_t>(job.buckets + 1));
  int64_t* const row_of = s.row_of.data();
  int32_t* const order = s.order.data();
  int32_t* const bucket_next = s.bucket_next.data();

  auto item_output = [&](int64_t item) __attribute__((always_inline)) {
    if (dense_output) return output + item * out_row_bytes;
    const int64_t t = item / nh;
    return output + t * out_token_bytes + (item - t * nh) * out_row_bytes;
  };
  const int64_t begin = block * job.block_items;
  const int64_t count = std::min(job.items - begin, job.block_items);
  // Resolve ids and write the zero rows now. The owned rows are counted per bucket of table rows,
  // then counting-sorted into table order (or listed in output order, below).
  std::fill(bucket_next, bucket_next + job.buckets + 1, 0);
  int64_t owned = 0, filled_buckets = 0;
  int64_t t = begin / nh, h = begin - t * nh;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = q.local_row(q.id_at(t, h));
    row_of[i] = row;
    if (row < 0) {
      write_row<true>(stores, output + t * out_token_bytes + h * out_row_bytes, nullptr,
                      out_row_bytes);
    } else {
      filled_buckets += bucket_next[(row >> shift) + 1]++ == 0;
    }
    if (++h == nh) h = 0, ++t;
  }
  // Rows that repeat so much that the block's distinct ones (at most one per filled bucket,
  // as buckets are about as many as items) fit in what this thread can keep in cache (its
  // share of the streaming threshold) need no page walk after their first use: sorting them would
  // only scatter the output's stores over its pages (1024 distinct rows, sorted: 0.70x
  // index_select; in output order: 1.14x). They are copied in output order.
  const bool sort = filled_buckets * row_bytes > job.cache_bytes;
  if (!sort) {
    for (int64_t i = 0; i < count; ++i) {
      if (row_of[i] >= 0) order[owned++] = static_cast<int32_t>(i);
    }
  } else {
    for (int64_t b = 0; b < job.buckets; ++b) bucket_next[b + 1] += bucket_next[b];
    owned = bucket_next[job.buckets];
    for (int64_t i = 0; i < count; ++i) {
      if (row_of[i] >= 0) order[bucket_next[row_of[i] >> shift]++] = static_cast<int32_t>(i);
    }
  }
  // Copy in that order, prefetching kPrefetchDistance rows ahead as the cached path does.
  const auto prefetch_row = [&](int64_t row) __attribute__((always_inline)) {
    prefetch_bytes(table + row * table_row_bytes, row_bytes);
    if constexpr (In == Dtype::kNvfp4) {
      prefetch_bytes(reinterpret_cast<const char*>(q.block_scales) +
                         row * q.block_scales_row_stride,
                     width / kNvfp4Block);
    }
  };
  for (int64_t j = 0; j < std::min(owned, kPrefetchDistance); ++j) prefetch_row(row_of[order[j]]);
  if constexpr (In == Out) {
    for (int64_t j = 0; j < owned; ++j) {
      if (j + kPrefetchDistance < owned) prefetch_row(row_of[order[j + kPrefetchDistance]]);
      const int64_t i = order[j];
      write_row<false>(stores, item_output(begin + i), table + row_of[i] * table_row_bytes,
                       row_bytes);
    }
  } else {
    const int64_t scale_bytes = In == Dtype::kNvfp4 ? width / kNvfp4Block : 0;
    const auto source = [&](int64_t j) __attribute__((always_inline)) {
      const int64_t row = row_of[order[j]];
      return std::pair<const char*, const uint8_t*>(
          table + row * table_row_bytes,
          In == Dtype::kNvfp4 ? q.block_scales + row * q.block_scales_row_stride : nullptr);
    };
    const auto prefetch = [&](int64_t j)
                              __attribute__((always_inline)) { prefetch_row(row_of[order[j]]); };
    // Converted through an L1-resident stage, then written with the path's stores; fp8 rows
    // with a vector lookup straight into streaming stores instead: the stage's extra write, read
    // and call per row made an fp8 prefill take 1.3x the time of a bf16 one at 2 threads (Zen 4).
    const auto emit = [&](int64_t j, const char* staged,
                          const uint8_t* scales) __attribute__((always_inline)) {
      char* dst = item_output(begin + order[j]);
      if constexpr (is_fp8(In)) {
        if (job.convert->fp8_rows_stream != nullptr && stores != RowStores::kPlain &&
            reinterpret_cast<uintptr_t>(dst) % job.convert->fp8_stream_align == 0) {
          job.convert->fp8_rows_stream(reinterpret_cast<const uint8_t*>(staged),
                                       reinterpret_cast<OutT*>(dst), width, *job.convert->fp8);
          return;
        }
      }
      constexpr int64_t kStage = kStageBytes / static_cast<int64_t>(sizeof(OutT));
      static_assert(kStage % kNvfp4Block == 0, "NVFP4 chunks must start on a block");
      alignas(64) OutT stage[kStage];
      for (int64_t c = 0; c < width; c += kStage) {
        const int64_t n = std::min(kStage, width - c);
        const auto* chunk = reinterpret_cast<const InT*>(staged) + c / elems_per_word(In);
        (*job.convert)(chunk, In == Dtype::kNvfp4 ? scales + c / kNvfp4Block : nullptr, stage, n);
        constexpr int64_t kOut = sizeof(OutT);
        write_row<false>(stores, dst + c * kOut, reinterpret_cast<const char*>(stage), n * kOut);
      }
    };
    convert_staged(owned, row_bytes, scale_bytes, source, prefetch, emit);
  }
#if QWEN4EXP_X86_AVX512
  // Streaming stores are weakly ordered: make them visible before this block counts as done.
  if (stores != RowStores::kPlain) _mm_sfence();
#endif
}

template <Dtype In, Dtype Out>
void gather_rows_streaming(const GatherRowsParams& p, const RowConverter<In, Out>& convert,
                           RowStores stores, int64_t stream_bytes_from) {
  const int64_t items = p.num_tokens * p.num_heads;
  const int64_t threads = cpu::num_threads();
  const int64_t l2_items = std::max(kStreamMinBlockItems, cache_share().l2 / kStreamScratchBytes);
  const int64_t block_items =
      std::clamp<int64_t>((items + threads - 1) / threads, kStreamMinBlockItems, l2_items);
  // Buckets of 2^shift rows, about as many buckets as items in a block: finer buys nothing (a
  // bucket then holds ~1 item), coarser leaves rows unsorted within a bucket.
  const int64_t last_row = std::max<int64_t>(p.rows, 1) - 1;
  int64_t shift = 0;
  while ((last_row >> shift) >= block_items) ++shift;
  const StreamJob<In, Out> job{p,
                               &convert,
                               stores,
                               items,
                               block_items,
                               (items + block_items - 1) / block_items,
                               shift,
                               (last_row >> shift) + 1,
                               stream_bytes_from / threads};
  cpu::parallel_blocks(job.blocks, 1, [&](int64_t block) { stream_block(job, block); });
}

// set_cpu_gather_stream_bytes's setting; -1: the default. Read with one relaxed load per call.
std::atomic<int64_t> stream_bytes_setting{-1};

}  // namespace

// Outputs of at least this many bytes take the streaming path; -1 where it is not available
// (no streaming stores: not x86-64, or no AVX). The default is what this process's threads can
// keep in cache (cache_share: per thread the core's L2 and its share of the L3); Python sets
// another (ops.set_cpu_gather_stream_bytes), so tests can force either path.
int64_t cpu_gather_stream_bytes() {
  if (best_row_stores() == RowStores::kPlain) return -1;
  const int64_t set = stream_bytes_setting.load(std::memory_order_relaxed);
  if (set >= 0) return set;
  const CacheShare& share = cache_share();
  return cpu::num_threads() * (share.l2 + share.l3);
}

int64_t set_cpu_gather_stream_bytes(int64_t bytes) {
  if (bytes < -1) {
    throw std::invalid_argument(
        "set_cpu_gather_stream_bytes: bytes must be >= 0 (or -1 for the "
        "default), got " +
        std::to_string(bytes));
  }
  return stream_bytes_setting.exchange(bytes);
}

namespace {

// set_cpu_gather_fp8_lookup's setting; kFp8LookupBest: the widest this CPU has.
std::atomic<int64_t> fp8_lookup_setting{kFp8LookupBest};

bool has_fp8_lookup(int64_t lookup) {
  if (lookup == kFp8LookupScalar) return true;
#if QWEN4EXP_X86_AVX512
  if (lookup == kFp8LookupAvx2) return simd::cpu_has_avx2();
  if (lookup == kFp8LookupAvx512) return simd::cpu_has_avx512bw_vl();
#endif
  return false;
}

}  // namespace

int64_t cpu_gather_fp8_lookup() {
  const int64_t set = fp8_lookup_setting.load(std::memory_order_relaxed);
  if (set != kFp8LookupBest) return set;
  if (has_fp8_lookup(kFp8LookupAvx512)) return kFp8LookupAvx512;
  if (has_fp8_lookup(kFp8LookupAvx2)) return kFp8LookupAvx2;
  return kFp8LookupScalar;
}

int64_t set_cpu_gather_fp8_lookup(int64_t lookup) {
  if (lookup < kFp8LookupBest || lookup > kFp8LookupAvx512) {
    throw std::invalid_argument(
        "set_cpu_gather_fp8_lookup: lookup must be -1 (the widest), 0 (scalar), 1 (avx2) or 2 "
        "(avx512), got " +
        std::to_string(lookup));
  }
  if (lookup != kFp8LookupBest && !has_fp8_lookup(lookup)) {
    throw std::invalid_argument(
        std::string("set_cpu_gather_fp8_lookup: the ") +
        (lookup == kFp8LookupAvx2 ? "avx2 lookup needs AVX2" : "avx512 lookup needs AVX-512BW") +
        ", which this CPU or build lacks");
  }
  return fp8_lookup_setting.exchange(lookup);
}

namespace {

// Items per unit of work. Workers take blocks from a shared counter instead of one fixed half
// each: on a shared host a worker whose core is busy with something else simply takes fewer
// blocks, where a static split would wait for it. Up to 1024 rows (320 KiB of bf16 output) per
// block keep the counter traffic and the prefetch ramp-up at each block start negligible; a
// small (decode) batch is cut into at least two blocks per thread, down to kMinBlockItems, so it
// still spreads over the cores.
constexpr int64_t kBlockItems = 1024;
constexpr int64_t kMinBlockItems = 128;

// `bytes` from src to dst in 64-byte pieces (the last one overlapping the one before it), moved
// in the clone's vector registers: a call to memcpy per row, whose size it must first sort out,
// took 1.4x the time for rows in L2 (1024 rows of 320 bytes, Zen 4).
QWEN4EXP_ALWAYS_INLINE void copy_row_bytes(char* __restrict dst, const char* __restrict src,
                                           int64_t bytes) {
  if (bytes < 64) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  int64_t k = 0;
  for (; k + 64 <= bytes; k += 64) __builtin_memcpy(dst + k, src + k, 64);
  if (k < bytes) __builtin_memcpy(dst + bytes - 64, src + bytes - 64, 64);
}

// The cached path's same-dtype copy of one block: rows[i] (null: a zero row) to the output of
// item i, which is head h of token t counting from (t0, h0); row i + kPrefetchDistance
// prefetched as row i is copied.
struct CopyBlock {
  const char* const* rows;
  int64_t count, row_bytes;
  char* output;
  int64_t out_token_bytes, num_heads, t0, h0;
};

QWEN4EXP_CPU_CLONES void copy_block(const CopyBlock& b) {
  const char* const* const rows = b.rows;
  const int64_t count = b.count, row_bytes = b.row_bytes, nh = b.num_heads;
  for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) {
    if (rows[i] != nullptr) prefetch_bytes(rows[i], row_bytes);
  }
  int64_t t = b.t0, h = b.h0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t ahead = i + kPrefetchDistance;
    if (ahead < count && rows[ahead] != nullptr) prefetch_bytes(rows[ahead], row_bytes);
    char* dst = b.output + t * b.out_token_bytes + h * row_bytes;
    if (rows[i] != nullptr) {
      copy_row_bytes(dst, rows[i], row_bytes);
    } else {
      std::memset(dst, 0, static_cast<size_t>(row_bytes));
    }
    if (++h == nh) h = 0, ++t;
  }
}

template <Dtype In, Dtype Out>
void gather_rows_cpu_impl(const GatherRowsParams& p) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const RowConverter<In, Out> convert(p);
  const int64_t out_bytes =
      p.num_tokens * p.num_heads * p.width * static_cast<int64_t>(sizeof(OutT));
  const int64_t stream_bytes_from = cpu_gather_stream_bytes();
  if (stream_bytes_from >= 0 && out_bytes >= stream_bytes_from) {
    return gather_rows_streaming<In, Out>(p, convert, best_row_stores(), stream_bytes_from);
  }
  // Locals, not loads through `p`: the row copies write through char-typed pointers, which may
  // alias anything, so the compiler would reload every field of `p` after each row.
  const char* const table = static_cast<const char*>(p.table);
  OutT* const output = static_cast<OutT*>(p.output);
  const int64_t nh = p.num_heads;
  const int64_t width = p.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT)) / elems_per_word(In);
  const int64_t table_row_bytes = p.table_row_stride * static_cast<int64_t>(sizeof(InT));
  constexpr bool kNvfp4 = In == Dtype::kNvfp4;
  const uint8_t* const block_scales = p.block_scales;
  const int64_t scale_row_stride = p.block_scales_row_stride;
  const int64_t scale_row_bytes = width / kNvfp4Block;
  const int64_t out_row_stride = p.output_row_stride;
  const int64_t items = p.num_tokens * nh;
  const int64_t threads = cpu::num_threads();
  const int64_t block_items =
      std::clamp<int64_t>(items / (2 * threads), kMinBlockItems, kBlockItems);
  const int64_t blocks = (items + block_items - 1) / block_items;
  const GatherRowsParams q = p;

  // One decode token is 16 rows: below a couple of blocks a second thread costs more than it
  // saves.
  cpu::parallel_blocks(blocks, 2, [&](int64_t block) {
    // Pass 1 resolves a block's ids into row addresses (nullptr: not owned, a zero row); pass 2
    // copies row i while prefetching row i + kPrefetchDistance. Keeping the id decoding and
    // bounds checks out of the copy loop leaves it as short as a plain memcpy loop, so the
    // out-of-order core runs far ahead and keeps the prefetched misses overlapping.
    const char* rows[kBlockItems];
    const uint8_t* scale_rows[kNvfp4 ? kBlockItems : 1];  // NVFP4: each row's block scales
    const int64_t begin = block * block_items;
    const int64_t count = std::min(items - begin, block_items);
    int64_t t = begin / nh, h = begin - t * nh;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = q.local_row(q.id_at(t, h));
      rows[i] = row >= 0 ? table + row * table_row_bytes : nullptr;
      if constexpr (kNvfp4) {
        scale_rows[i] = row >= 0 ? block_scales + row * scale_row_stride : nullptr;
      }
      if (++h == nh) h = 0, ++t;
    }
    t = begin / nh;
    h = begin - t * nh;
    if constexpr (In == Out) {
      copy_block({rows, count, row_bytes, reinterpret_cast<char*>(output),
                  out_row_stride * static_cast<int64_t>(sizeof(OutT)), nh, t, h});
    } else {
      const auto prefetch_item = [&](int64_t i) __attribute__((always_inline)) {
        if (rows[i] == nullptr) return;
        prefetch_bytes(rows[i], row_bytes);
        if constexpr (kNvfp4)
          prefetch_bytes(reinterpret_cast<const char*>(scale_rows[i]), scale_row_bytes);
      };
      const auto write_out = [&](const char* row,
                                 const uint8_t* scales) __attribute__((always_inline)) {
        OutT* dst = output + t * out_row_stride + h * width;
        if (row != nullptr) {
          convert(reinterpret_cast<const InT*>(row), scales, dst, width);
        } else {
          std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(width) * sizeof(OutT));
        }
        if (++h == nh) h = 0, ++t;
      };
      for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) prefetch_item(i);
      const auto source = [&](int64_t i) __attribute__((always_inline)) {
        return std::pair<const char*, const uint8_t*>(rows[i], kNvfp4 ? scale_rows[i] : nullptr);
      };
      convert_staged(count, row_bytes, kNvfp4 ? scale_row_bytes : 0, source, prefetch_item,
                     [&](int64_t, const char* staged, const uint8_t* scales)
                         __attribute__((always_inline)) { write_out(staged, scales); });
    }
  });
}

}  // namespace

void run_gather_rows_cpu(const GatherRowsParams& p) {
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  const auto unsupported = [] {
    throw std::invalid_argument("gather_rows: no CPU kernel for this table and output dtype");
  };
  dispatch_dtype(
      kTableDtypes, p.table_dtype,
      [&](auto in) {
        dispatch_dtype(
            kFloatDtypes, p.out_dtype,
            [&](auto out) { gather_rows_cpu_impl<decltype(in)::kDtype, decltype(out)::kDtype>(p); },
            unsupported);
      },
      unsupported);
}

}  // namespace qwen4exp
