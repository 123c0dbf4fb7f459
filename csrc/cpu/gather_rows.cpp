// CPU kernel for gather_rows (SPEC.md §4).
//
// A random row of a table far larger than the caches is a DRAM miss (and usually a TLB miss): the
// gather is latency-bound, not bandwidth-bound. So each worker walks its (token, head) items in
// order and, kPrefetchDistance items ahead, issues software prefetches for every cache line of the
// row it will need: that keeps many misses in flight per core instead of one row at a time, which
// is what F.embedding / index_select do. The rows themselves are then plain copies (same dtype),
// one table lookup per byte (fp8: a 256-entry table of already-scaled, already-rounded outputs),
// a vectorised decode of two E2M1 codes per byte with the row's block scales (NVFP4), or a
// decode/round loop (other conversions). All offsets are int64: the released table holds
// 51.2 billion elements.
//
// An output larger than the last-level cache (a prefill) takes the streaming path instead, where
// the CPU has AVX-512: see "The streaming path" below.
#include <ATen/Parallel.h>
#include <torch/all.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

// The AVX-512 paths (streaming stores, in-register fp8 tables) are compiled on x86-64 with
// per-function target attributes and chosen at run time: the wheel itself stays baseline x86-64.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QWEN4EXP_X86_AVX512 1
#else
#define QWEN4EXP_X86_AVX512 0
#endif

#include "../gather_rows_args.h"
#include "simd.h"

namespace qwen4exp {
namespace {

// Items (rows) looked ahead. One row of the released table is 320 bytes (bf16) = 5 lines, so 16
// rows keep ~80 line fills outstanding per core: enough to cover DRAM + page-walk latency while
// staying well inside L1/L2 (what is prefetched is consumed a few hundred ns later).
// Where the time goes (perf, cpu-clock, CI host, 4 KiB pages): 93% of the cached path's samples
// sit on the instruction after a prefetcht1: a prefetch that misses the TLB holds retirement
// until its page walk ends, so the reorder buffer (a few rows of this loop), not the distance,
// bounds the walks in flight. Issuing a group's prefetches in a tight loop ahead of its copies
// measured 10-60% slower; sorting by address (the streaming path) is what made walks cheaper.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

// always_inline is load-bearing: GCC's IPA treats __builtin_prefetch as free of side effects,
// so a helper that only prefetches is classified "const" and every call to it is deleted as dead
// code (GCC 12 -O3 drops them all). Inlined, the prefetches stay in the loop.
// Locality 2 (prefetcht1: into L2 and below) rather than 0 (prefetchnta): on the 2-core Zen 4
// CI host, T = 8192 x 16 bf16 rows from a 4M-row table took 3.4 ms instead of 4.0 ms on a
// huge-page table and ~5.1 ms either way on 4 KiB pages (medians of 21, same run); distances
// 8-32 were within noise of 16.
__attribute__((always_inline)) inline void prefetch_bytes(const char* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(begin + bytes - 1);
  for (uintptr_t line = first; line <= last; line += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

// --- fp8 dequantisation: a 256-entry table lookup per byte ------------------------------------
//
// Every fp8 byte has one possible output (its value times the scale, rounded to the output type),
// so each call builds all 256 and the row conversion is a table lookup per byte. One lookup at a
// time costs ~1 ns per element, which made the fp8 gather compute-bound (prefill: 10 ms against
// 4.2 ms for the bf16 gather of twice the bytes). With AVX-512 the table lives in registers and
// vpermi2w / vpermi2ps look up 32 (16-bit outputs) or 16 (fp32) bytes per instruction: the 256
// entries are 4 (8) slices of 64 (32), one permute per slice, then the upper index bits pick the
// slice with masked blends. Bit-identical to the scalar lookup by construction (same table).
// Measured on the CI host, T = 64 x 16 rows of 160 from a cached table: fp8 -> bf16 went from
// 3.0x to 1.3x the time of the bf16 copy; fp8 -> fp32 (8 permutes per 16) only from 2.7x to 2.3x.
// Cold 4M-row tables, prefill T = 8192: fp8 6.6 ms next to bf16 5.3 ms (it was 10-16 ms).

template <typename OutT>
void lut_rows_scalar(const uint8_t* __restrict src, OutT* __restrict dst, int64_t n,
                     const OutT* __restrict lut) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
}

#if QWEN4EXP_X86_AVX512
#define QWEN4EXP_AVX512 __attribute__((target("avx512f")))
#define QWEN4EXP_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))

bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

bool cpu_has_avx512bw_vl() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
}

// 16-bit outputs (bf16, fp16): 32 bytes per step.
QWEN4EXP_AVX512BW void lut_rows_avx512(const uint8_t* __restrict src, uint16_t* __restrict dst,
                                       int64_t n, const uint16_t* __restrict lut) {
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
    _mm512_storeu_si512(dst + i, lookup(idx));
  }
  if (i < n) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1);
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(tail, src + i));
    _mm512_mask_storeu_epi16(dst + i, tail, lookup(idx));
  }
}

// fp32 outputs: 16 bytes per step.
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
    _mm512_storeu_ps(dst + i, lookup(idx));
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
// inf) cost 5x a plain row copy: T = 64 x 16 rows of 160 from a cached table, fp16 -> fp32
// 115 us and bf16 -> fp16 104 us against 20 us for the bf16 copy; vectorised, 47 and 56 us.
template <GatherDtype T>  // simd.h's element type of a (non-fp8) format
using simd_t = std::conditional_t<T == GatherDtype::kBF16, bf16_t,
                                  std::conditional_t<T == GatherDtype::kF16, f16_t, float>>;

template <typename InV, typename OutV>
QWEN4EXP_ALWAYS_INLINE void convert_rows_body(const InV* src, OutV* dst, int64_t n) {
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) simd::store(dst + i, simd::load(src + i));
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    simd::store_n(dst + i, simd::load_n(src + i, rest), rest);
  }
}

#define QWEN4EXP_CONVERT_ROWS(NAME, IN, OUT)                                \
  QWEN4EXP_CPU_CLONES void NAME(const IN* src, OUT* dst, int64_t n) {      \
    convert_rows_body(src, dst, n);                                         \
  }
QWEN4EXP_CONVERT_ROWS(convert_f32_bf16, float, bf16_t)
QWEN4EXP_CONVERT_ROWS(convert_f32_f16, float, f16_t)
QWEN4EXP_CONVERT_ROWS(convert_bf16_f32, bf16_t, float)
QWEN4EXP_CONVERT_ROWS(convert_bf16_f16, bf16_t, f16_t)
QWEN4EXP_CONVERT_ROWS(convert_f16_f32, f16_t, float)
QWEN4EXP_CONVERT_ROWS(convert_f16_bf16, f16_t, bf16_t)
#undef QWEN4EXP_CONVERT_ROWS

template <GatherDtype In, GatherDtype Out>
void convert_rows(const storage_t<In>* src, storage_t<Out>* dst, int64_t n) {
  const auto* in = reinterpret_cast<const simd_t<In>*>(src);
  auto* out = reinterpret_cast<simd_t<Out>*>(dst);
  if constexpr (In == GatherDtype::kF32 && Out == GatherDtype::kBF16) convert_f32_bf16(in, out, n);
  if constexpr (In == GatherDtype::kF32 && Out == GatherDtype::kF16) convert_f32_f16(in, out, n);
  if constexpr (In == GatherDtype::kBF16 && Out == GatherDtype::kF32) convert_bf16_f32(in, out, n);
  if constexpr (In == GatherDtype::kBF16 && Out == GatherDtype::kF16) convert_bf16_f16(in, out, n);
  if constexpr (In == GatherDtype::kF16 && Out == GatherDtype::kF32) convert_f16_f32(in, out, n);
  if constexpr (In == GatherDtype::kF16 && Out == GatherDtype::kBF16) convert_f16_bf16(in, out, n);
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
// scales with fp8_e4m3fn_to_float's branches, made the decode 2.9x slower (AVX2 clone, 2-core
// EPYC: 2.0 against 0.7 ns per element).
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
      const u32x8 magnitude =
          m >= 2u ? 0x3F000000u + (m << 22) : (m == 1u ? simd::splat_u(0x3F000000u) : 0u);
      const simd::f32x8 e2m1 = simd::as_f32(magnitude | ((codes & 8u) << 28));
      simd::store(dst + block * kNvfp4Block + half * 8, (e2m1 * block_scale) * global);
    }
  }
}

#define QWEN4EXP_NVFP4_ROWS(NAME, OUT)                                                   \
  QWEN4EXP_CPU_CLONES void NAME(const uint8_t* src, const uint8_t* scales, OUT* dst,     \
                                int64_t n, float global_scale, const float* scale_values) { \
    nvfp4_rows_body(src, scales, dst, n, global_scale, scale_values);                    \
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

template <GatherDtype Out>
void nvfp4_rows(const uint8_t* src, const uint8_t* scales, storage_t<Out>* dst, int64_t n,
                float global_scale, const float* scale_values) {
  auto* out = reinterpret_cast<simd_t<Out>*>(dst);
  const float g = global_scale;
  if constexpr (Out == GatherDtype::kF32) nvfp4_rows_f32(src, scales, out, n, g, scale_values);
  if constexpr (Out == GatherDtype::kBF16) nvfp4_rows_bf16(src, scales, out, n, g, scale_values);
  if constexpr (Out == GatherDtype::kF16) nvfp4_rows_f16(src, scales, out, n, g, scale_values);
}

// Converts `width` elements of one table row; `scales` is the row's NVFP4 block scales (unused,
// and null, for other formats). An NVFP4 `src` may start at any multiple of kNvfp4Block elements.
template <GatherDtype In, GatherDtype Out>
struct RowConverter {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  std::array<OutT, 256> lut{};  // fp8 only
  void (*lut_rows)(const uint8_t*, OutT*, int64_t, const OutT*) = &lut_rows_scalar<OutT>;
  float global_scale = 0.0f;              // NVFP4 only
  const float* scale_values = nullptr;    // NVFP4 only: e4m3fn_values()

  explicit RowConverter(const GatherRowsParams& p) {
    if constexpr (In == GatherDtype::kNvfp4) {
      global_scale = *p.scale;
      scale_values = e4m3fn_values();
    }
    if constexpr (is_fp8(In)) {
      // Every fp8 byte has one possible output: build all 256 once per call.
      const float scale_out = round_scale<Out>(*p.scale);
      for (int b = 0; b < 256; ++b) {
        lut[b] = dequantize<In, Out>(static_cast<uint8_t>(b), scale_out);
      }
#if QWEN4EXP_X86_AVX512
      if (cpu_has_avx512bw_vl()) lut_rows = &lut_rows_avx512;
#endif
    }
  }

  void operator()(const InT* __restrict src, [[maybe_unused]] const uint8_t* __restrict scales,
                  OutT* __restrict dst, int64_t width) const {
    if constexpr (In == GatherDtype::kNvfp4) {
      nvfp4_rows<Out>(src, scales, dst, width, global_scale, scale_values);
    } else if constexpr (In == Out) {
      std::memcpy(dst, src, static_cast<size_t>(width) * sizeof(InT));
    } else if constexpr (is_fp8(In)) {
      lut_rows(src, dst, width, lut.data());
    } else {
      convert_rows<In, Out>(src, dst, width);
    }
  }
};

// --- The streaming path ---------------------------------------------------------------------
//
// When the output is larger than the last-level cache, two things change. (1) Its lines would be
// read from DRAM before being overwritten (read-for-ownership) and evicted again before anyone
// reads them: streaming (non-temporal) stores write whole lines straight to memory instead, a
// third less DRAM traffic. (2) Rows need not be read in output order any more, since stores no
// longer go through the cache: each block of items is counting-sorted by table address first, so
// the row reads sweep the table upwards — consecutive rows share page-table lines and DRAM pages,
// and the page walk that every random row of a multi-GB table costs gets cheaper. Measured on the
// CI host (Zen 4 in a VM, 2 cores), T = 8192 × 16 bf16 rows of 160 from a 4M-row table, medians
// of 12, same runs: cached path 3.7-5.0 ms, streaming in output order 3.3-3.6 ms, sorted and
// streaming 2.9-3.3 ms (index_select 5.3-7.9 ms; a copy of the same bytes 2.5-2.8 ms).
//
// AVX-512 only: 64-byte streaming stores write a whole line in one instruction. With 16-byte
// (SSE2) or 32-byte (AVX) streaming stores the same loop measured slower than the cached path
// there (5.2 and 5.5 ms against 3.7-5.0), so other CPUs keep the cached path.
#if QWEN4EXP_X86_AVX512

// Items per sorted block: 32768 rows of 320 bytes (10 MiB) spread over a 4M-row table put a
// row every ~40 KiB; bigger blocks sort better but start the copy later and balance worse. At
// least two blocks per thread (as on the cached path: a thread whose core is busy takes fewer),
// down to 1024 items, so that a many-core host still puts every core to work.
constexpr int64_t kStreamBlockItems = 32768;
constexpr int64_t kStreamMinBlockItems = 1024;
// Conversions are staged through an L1-resident buffer of this many bytes, then streamed out.
constexpr int64_t kStageBytes = 2048;

// Writes `bytes` at `dst`, copied from `src` (or zeros, with kZeros; `src` is then unused):
// whole 64-byte lines of `dst` with streaming stores, the unaligned head and tail (if any) with
// ordinary ones. `src` may be unaligned. The common case (a row of whole, aligned lines: d = 160
// bf16) has its own plain loop: going through the head/tail arithmetic made the whole gather
// ~20% slower on the CI host (3.9-4.4 ms against 3.1-3.4).
template <bool kZeros>
QWEN4EXP_AVX512 __attribute__((always_inline)) inline void stream_out(char* dst, const char* src,
                                                                     int64_t bytes) {
  // The 64 bytes at offset `at`, and the plain copy of `n` bytes at `at` (src untouched when
  // kZeros: it may be null).
  const auto line = [src](int64_t at) QWEN4EXP_AVX512 __attribute__((always_inline)) {
    if constexpr (kZeros) {
      return _mm512_setzero_si512();
    } else {
      return _mm512_loadu_si512(src + at);
    }
  };
  const auto plain = [dst, src](int64_t at, int64_t n) __attribute__((always_inline)) {
    if constexpr (kZeros) {
      std::memset(dst + at, 0, static_cast<size_t>(n));
    } else {
      std::memcpy(dst + at, src + at, static_cast<size_t>(n));
    }
  };
  if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 63) == 0) {
    for (int64_t i = 0; i < bytes; i += 64) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), line(i));
    }
    return;
  }
  const int64_t head =
      std::min<int64_t>(bytes, static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & 63));
  plain(0, head);
  int64_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), line(i));
  }
  plain(i, bytes - i);
}

// A worker's sort buffers, kept across calls (no page faults on 0.5 MiB per block).
struct StreamScratch {
  std::vector<int64_t> row_of;       // [block] table row of each item, -1: a zero row
  std::vector<int32_t> order;        // [block] the owned items, by table row bucket
  std::vector<int32_t> bucket_next;  // [buckets + 1] counting-sort offsets
};

StreamScratch& stream_scratch() {
  thread_local StreamScratch scratch;
  return scratch;
}

template <GatherDtype In, GatherDtype Out>
struct StreamJob {
  GatherRowsParams p;
  const RowConverter<In, Out>* convert;
  int64_t items, block_items, blocks, shift, buckets;
  std::atomic<int64_t>* next_block;
};

// One worker: takes blocks from the shared counter until none are left. A named function, not
// the parallel_for lambda, so that it is compiled for AVX-512 (a lambda gets the baseline target).
template <GatherDtype In, GatherDtype Out>
QWEN4EXP_AVX512 void stream_worker(const StreamJob<In, Out>& job) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const GatherRowsParams& q = job.p;
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

  auto item_output = [&](int64_t item) QWEN4EXP_AVX512 {
    if (dense_output) return output + item * out_row_bytes;
    const int64_t t = item / nh;
    return output + t * out_token_bytes + (item - t * nh) * out_row_bytes;
  };
  for (int64_t block = job.next_block->fetch_add(1, std::memory_order_relaxed); block < job.blocks;
       block = job.next_block->fetch_add(1, std::memory_order_relaxed)) {
    const int64_t begin = block * job.block_items;
    const int64_t count = std::min(job.items - begin, job.block_items);
    // Resolve ids, write the zero rows now, count the owned rows per bucket of table rows.
    std::fill(bucket_next, bucket_next + job.buckets + 1, 0);
    int64_t t = begin / nh, h = begin - t * nh;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = q.local_row(q.id_at(t, h));
      row_of[i] = row;
      if (row >= 0) {
        ++bucket_next[(row >> shift) + 1];
      } else {
        stream_out<true>(output + t * out_token_bytes + h * out_row_bytes, nullptr, out_row_bytes);
      }
      if (++h == nh) h = 0, ++t;
    }
    for (int64_t b = 0; b < job.buckets; ++b) bucket_next[b + 1] += bucket_next[b];
    const int64_t owned = bucket_next[job.buckets];
    for (int64_t i = 0; i < count; ++i) {
      if (row_of[i] >= 0) order[bucket_next[row_of[i] >> shift]++] = static_cast<int32_t>(i);
    }
    // Copy in table order, prefetching kPrefetchDistance rows ahead as the cached path does.
    const auto prefetch_row = [&](int64_t row) QWEN4EXP_AVX512 __attribute__((always_inline)) {
      prefetch_bytes(table + row * table_row_bytes, row_bytes);
      if constexpr (In == GatherDtype::kNvfp4) {
        prefetch_bytes(reinterpret_cast<const char*>(q.block_scales) +
                           row * q.block_scales_row_stride,
                       width / kNvfp4Block);
      }
    };
    for (int64_t j = 0; j < std::min(owned, kPrefetchDistance); ++j) prefetch_row(row_of[order[j]]);
    for (int64_t j = 0; j < owned; ++j) {
      if (j + kPrefetchDistance < owned) prefetch_row(row_of[order[j + kPrefetchDistance]]);
      const int64_t i = order[j];
      const char* src = table + row_of[i] * table_row_bytes;
      const uint8_t* scales = In == GatherDtype::kNvfp4
                                  ? q.block_scales + row_of[i] * q.block_scales_row_stride
                                  : nullptr;
      char* dst = item_output(begin + i);
      if constexpr (In == Out) {
        stream_out<false>(dst, src, row_bytes);
      } else {
        constexpr int64_t kStage = kStageBytes / static_cast<int64_t>(sizeof(OutT));
        static_assert(kStage % kNvfp4Block == 0, "NVFP4 chunks must start on a block");
        alignas(64) OutT stage[kStage];
        for (int64_t c = 0; c < width; c += kStage) {
          const int64_t n = std::min(kStage, width - c);
          const auto* chunk = reinterpret_cast<const InT*>(src) + c / elems_per_word(In);
          (*job.convert)(chunk, scales == nullptr ? nullptr : scales + c / kNvfp4Block, stage, n);
          constexpr int64_t kOut = sizeof(OutT);
          stream_out<false>(dst + c * kOut, reinterpret_cast<const char*>(stage), n * kOut);
        }
      }
    }
  }
  // Streaming stores are weakly ordered: make them visible before this worker reports done.
  _mm_sfence();
}

template <GatherDtype In, GatherDtype Out>
void gather_rows_streaming(const GatherRowsParams& p, const RowConverter<In, Out>& convert) {
  const int64_t items = p.num_tokens * p.num_heads;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t block_items = std::clamp<int64_t>((items + 2 * threads - 1) / (2 * threads),
                                                  kStreamMinBlockItems, kStreamBlockItems);
  // Buckets of 2^shift rows, about as many buckets as items in a block: finer buys nothing (a
  // bucket then holds ~1 item), coarser leaves rows unsorted within a bucket.
  const int64_t last_row = std::max<int64_t>(p.rows, 1) - 1;
  int64_t shift = 0;
  while ((last_row >> shift) >= block_items) ++shift;
  std::atomic<int64_t> next_block{0};
  const StreamJob<In, Out> job{p,
                               &convert,
                               items,
                               block_items,
                               (items + block_items - 1) / block_items,
                               shift,
                               (last_row >> shift) + 1,
                               &next_block};
  at::parallel_for(0, job.blocks, 1, [&](int64_t, int64_t) { stream_worker(job); });
}

#endif  // QWEN4EXP_X86_AVX512

// The last-level cache of one core, from sysfs ("32768K"); 32 MiB where it cannot be read.
// (sysconf(_SC_LEVEL3_CACHE_SIZE) is no substitute: on EPYC it reports every CCD's L3 together.)
[[maybe_unused]] int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t best = 0;
    for (int index = 0; index < 8; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
      std::ifstream level_file(dir + "/level"), size_file(dir + "/size"), type_file(dir + "/type");
      int level = 0;
      std::string size, type;
      if (!(level_file >> level) || !(size_file >> size) || !(type_file >> type)) continue;
      if (type == "Instruction" || size.empty()) continue;
      int64_t value = std::strtoll(size.c_str(), nullptr, 10);
      const char unit = size.back();
      if (unit == 'K') value <<= 10;
      if (unit == 'M') value <<= 20;
      if (level >= 2 && value > best) best = value;
    }
    return best > 0 ? best : int64_t{32} << 20;
  }();
  return bytes;
}

}  // namespace

// Outputs of at least this many bytes take the streaming path; -1 where it is not available
// (no AVX-512, or not x86-64). QWEN4EXP_CPU_GATHER_STREAM_BYTES overrides the default, the
// last-level cache size; read on every call, like QWEN4EXP_DEBUG_CHECKS, so tests can force
// either path.
int64_t cpu_gather_stream_bytes() {
#if QWEN4EXP_X86_AVX512
  if (!cpu_has_avx512f()) return -1;
  const char* value = std::getenv("QWEN4EXP_CPU_GATHER_STREAM_BYTES");
  if (value == nullptr || *value == '\0') return last_level_cache_bytes();
  char* end = nullptr;
  errno = 0;
  const long long bytes = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && *end == '\0' && bytes >= 0,
              "QWEN4EXP_CPU_GATHER_STREAM_BYTES must be a byte count >= 0, got '", value, "'");
  return bytes;
#else
  return -1;
#endif
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

template <GatherDtype In, GatherDtype Out>
void gather_rows_cpu_impl(const GatherRowsParams& p) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const RowConverter<In, Out> convert(p);
#if QWEN4EXP_X86_AVX512
  const int64_t stream_bytes_from = cpu_gather_stream_bytes();
  const int64_t out_bytes =
      p.num_tokens * p.num_heads * p.width * static_cast<int64_t>(sizeof(OutT));
  if (stream_bytes_from >= 0 && out_bytes >= stream_bytes_from) {
    return gather_rows_streaming<In, Out>(p, convert);
  }
#endif
  // Locals, not loads through `p`: the row copies write through char-typed pointers, which may
  // alias anything, so the compiler would reload every field of `p` after each row.
  const char* const table = static_cast<const char*>(p.table);
  OutT* const output = static_cast<OutT*>(p.output);
  const int64_t nh = p.num_heads;
  const int64_t width = p.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT)) / elems_per_word(In);
  const int64_t table_row_bytes = p.table_row_stride * static_cast<int64_t>(sizeof(InT));
  constexpr bool kNvfp4 = In == GatherDtype::kNvfp4;
  const uint8_t* const block_scales = p.block_scales;
  const int64_t scale_row_stride = p.block_scales_row_stride;
  const int64_t scale_row_bytes = width / kNvfp4Block;
  const int64_t out_row_stride = p.output_row_stride;
  const int64_t items = p.num_tokens * nh;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t block_items =
      std::clamp<int64_t>(items / (2 * threads), kMinBlockItems, kBlockItems);
  const int64_t blocks = (items + block_items - 1) / block_items;
  const GatherRowsParams q = p;

  std::atomic<int64_t> next_block{0};
  // One decode token is 16 rows: below a couple of blocks a second thread costs more than it
  // saves.
  at::parallel_for(0, blocks, 2, [&](int64_t, int64_t) {
    // Pass 1 resolves a block's ids into row addresses (nullptr: not owned, a zero row); pass 2
    // copies row i while prefetching row i + kPrefetchDistance. Keeping the id decoding and
    // bounds checks out of the copy loop leaves it as short as a plain memcpy loop, so the
    // out-of-order core runs far ahead and keeps the prefetched misses overlapping.
    const char* rows[kBlockItems];
    const uint8_t* scale_rows[kNvfp4 ? kBlockItems : 1];  // NVFP4: each row's block scales
    for (int64_t block = next_block.fetch_add(1, std::memory_order_relaxed); block < blocks;
         block = next_block.fetch_add(1, std::memory_order_relaxed)) {
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
      const auto prefetch_item = [&](int64_t i) __attribute__((always_inline)) {
        if (rows[i] == nullptr) return;
        prefetch_bytes(rows[i], row_bytes);
        if constexpr (kNvfp4) prefetch_bytes(reinterpret_cast<const char*>(scale_rows[i]),
                                             scale_row_bytes);
      };
      for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) prefetch_item(i);
      t = begin / nh;
      h = begin - t * nh;
      for (int64_t i = 0; i < count; ++i) {
        if (i + kPrefetchDistance < count) prefetch_item(i + kPrefetchDistance);
        OutT* dst = output + t * out_row_stride + h * width;
        if (rows[i] != nullptr) {
          convert(reinterpret_cast<const InT*>(rows[i]), kNvfp4 ? scale_rows[i] : nullptr, dst,
                  width);
        } else {
          std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(width) * sizeof(OutT));
        }
        if (++h == nh) h = 0, ++t;
      }
    }
  });
}



template <GatherDtype In>
void dispatch_out(const GatherRowsParams& p) {
  switch (p.out_dtype) {
    case GatherDtype::kF32: return gather_rows_cpu_impl<In, GatherDtype::kF32>(p);
    case GatherDtype::kBF16: return gather_rows_cpu_impl<In, GatherDtype::kBF16>(p);
    case GatherDtype::kF16: return gather_rows_cpu_impl<In, GatherDtype::kF16>(p);
    default: TORCH_CHECK(false, "gather_rows: unsupported output dtype");
  }
}

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& ids,
                     const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& block_scales, int64_t vocab_start,
                     int64_t vocab_end, const at::Tensor& output) {
  const GatherRowsParams p =
      check_gather_rows_args(table, ids, scale, block_scales, vocab_start, vocab_end, output);
  TORCH_CHECK(table.device().is_cpu(), "gather_rows: CPU kernel called with ", table.device(),
              " tensors");
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  switch (p.table_dtype) {
    case GatherDtype::kF32: return dispatch_out<GatherDtype::kF32>(p);
    case GatherDtype::kBF16: return dispatch_out<GatherDtype::kBF16>(p);
    case GatherDtype::kF16: return dispatch_out<GatherDtype::kF16>(p);
    case GatherDtype::kFp8E4M3FN: return dispatch_out<GatherDtype::kFp8E4M3FN>(p);
    case GatherDtype::kFp8E4M3FNUZ: return dispatch_out<GatherDtype::kFp8E4M3FNUZ>(p);
    case GatherDtype::kNvfp4: return dispatch_out<GatherDtype::kNvfp4>(p);
  }
}

}  // namespace
}  // namespace qwen4exp

TORCH_LIBRARY_IMPL(qwen4exp, CPU, m) {
  m.impl("gather_rows", &qwen4exp::gather_rows_cpu);
}
