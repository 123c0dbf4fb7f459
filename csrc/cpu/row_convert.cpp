// row_convert.h's out-of-line parts: the float and NVFP4 row loops, each compiled for AVX-512,
// AVX2 and baseline x86-64 (target_clones) and handed out by address (row_loops), the e4m3fn
// table, and set_cpu_gather_fp8_lookup.
#include "row_convert.h"

#include <atomic>
#include <stdexcept>
#include <string>

namespace qwen4exp {
namespace cpu {
namespace {

// --- Other conversions (fp32 / bf16 / fp16 to one another): row_convert.h ----------------------

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

// --- NVFP4: row_convert.h ------------------------------------------------------------------

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
    uint64_t packed;  // little-endian: byte k at bits 8k (asserted above)
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

}  // namespace

const RowLoops& row_loops() {
  static const RowLoops loops{convert_f32_bf16, convert_f32_f16, convert_bf16_f32,
                              convert_bf16_f16, convert_f16_f32, convert_f16_bf16,
                              nvfp4_rows_f32,   nvfp4_rows_bf16, nvfp4_rows_f16};
  return loops;
}

// The 256 float8_e4m3fn values, decoded once per process.
const float* e4m3fn_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[b] = fp8_e4m3fn_to_float(static_cast<uint8_t>(b));
    return v;
  }();
  return values.data();
}

}  // namespace cpu

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

}  // namespace qwen4exp
