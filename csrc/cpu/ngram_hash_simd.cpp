// ngram_ids' head reduction in three widths (see ngram_hash_simd.h), and the setting that picks
// one (cpu_ngram_hash_isa). The vector kernels carry per-function target attributes and run only
// where the CPU reports the instructions (simd.h's cpu_has_*): the build needs no -march flag
// and the library stays baseline x86-64.
#include "ngram_hash_simd.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include "../common/ngram_ids.h"
#include "simd.h"

namespace qwen4exp {
namespace cpu {

HeadLanes::HeadLanes(const int64_t* sizes, const int64_t* offsets, int num_heads,
                     int heads_per_ngram)
    : num_heads_(num_heads),
      padded_((num_heads + kHeadLanes - 1) / kHeadLanes * kHeadLanes),
      divmod_(num_heads),
      rows_(static_cast<size_t>(kRows) * padded_) {
  const FastDivmodU64 one = make_fast_divmod(1);
  for (int h = 0; h < padded_; ++h) {
    const bool live = h < num_heads;
    const FastDivmodU64 f = live ? make_fast_divmod(static_cast<uint64_t>(sizes[h])) : one;
    if (live) divmod_[h] = f;
    const uint64_t slot = live ? static_cast<uint64_t>(h / heads_per_ngram) : 0;
    const uint64_t pair = slot % 4 * 2;
    const uint64_t values[kRows] = {
        f.multiplier,
        f.multiplier >> 32,
        f.divisor,
        f.divisor >> 32,
        f.shift1,
        f.shift2,
        f.two64_mod,
        live ? static_cast<uint64_t>(offsets[h]) : 0,
        slot,
        pair | (pair + 1) << 32,
        slot >= 4 ? ~uint64_t{0} : 0,
    };
    for (int r = 0; r < kRows; ++r) rows_[static_cast<size_t>(r) * padded_ + h] = values[r];
  }
}

namespace {

template <typename OutT>
void reduce_scalar(const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens, OutT* out,
                   int64_t row_stride, int64_t col_stride) {
  for (int64_t t = 0; t < tokens; ++t) {
    const uint64_t* mix = mixes + t * kMixSlots;
    OutT* row = out + t * row_stride;
    for (int h = 0; h < lanes.num_heads(); ++h) {
      const int64_t residue =
          floor_mod_i64(lanes.divmod(h), static_cast<int64_t>(mix[lanes.order(h)]));
      row[h * col_stride] = static_cast<OutT>(residue + lanes.offset(h));
    }
  }
}

// Lanes [0, live) of ids (the low 64 bits of each, as OutT) to row[k·col_stride]: strided
// outputs, which no vector store reaches.
template <typename OutT>
void store_strided(OutT* row, int64_t col_stride, const uint64_t* ids, int live) {
  for (int k = 0; k < live; ++k)
    row[k * col_stride] = static_cast<OutT>(static_cast<int64_t>(ids[k]));
}

#if QWEN4EXP_X86_AVX512

// GCC 12's AVX-512 headers seed the unmasked intrinsics' pass-through operand with a
// self-initialised "undefined" vector, which -Wmaybe-uninitialized reports wherever they inline
// (GCC bug 105593, fixed in 13): nothing here reads an uninitialised value.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define QWEN4EXP_TARGET_AVX2 __attribute__((target("avx2")))
#define QWEN4EXP_TARGET_AVX512 __attribute__((target("avx512f,avx512dq")))

// ---- AVX2: 4 heads a step -------------------------------------------------------------------

// The high 64 bits of a·b per lane, from 32x32->64 products (a_hi, b_hi: the high halves). The
// partial sums cannot overflow: hl + (ll >> 32) and lh + (low half of that) stay below 2^64.
QWEN4EXP_TARGET_AVX2 inline __m256i mul_hi_u64_avx2(__m256i a, __m256i a_hi, __m256i b,
                                                    __m256i b_hi) {
  const __m256i low32 = _mm256_set1_epi64x(0xFFFFFFFF);
  const __m256i ll = _mm256_mul_epu32(a, b);
  const __m256i lh = _mm256_mul_epu32(a, b_hi);
  const __m256i hl = _mm256_mul_epu32(a_hi, b);
  const __m256i hh = _mm256_mul_epu32(a_hi, b_hi);
  const __m256i mid = _mm256_add_epi64(hl, _mm256_srli_epi64(ll, 32));
  const __m256i mid2 = _mm256_add_epi64(lh, _mm256_and_si256(mid, low32));
  return _mm256_add_epi64(_mm256_add_epi64(hh, _mm256_srli_epi64(mid, 32)),
                          _mm256_srli_epi64(mid2, 32));
}

// floor_mod_i64 (fast_divmod.h) per lane: the same steps, so the same residues.
QWEN4EXP_TARGET_AVX2 inline __m256i floor_mod_avx2(__m256i n, const __m256i* c) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i t1 = mul_hi_u64_avx2(n, _mm256_srli_epi64(n, 32), c[HeadLanes::kMultiplier],
                                     c[HeadLanes::kMultiplierHigh]);
  const __m256i q = _mm256_srlv_epi64(
      _mm256_add_epi64(t1, _mm256_srlv_epi64(_mm256_sub_epi64(n, t1), c[HeadLanes::kShift1])),
      c[HeadLanes::kShift2]);
  // q·d mod 2^64 = q_lo·d_lo + ((q_hi·d_lo + q_lo·d_hi) << 32)
  const __m256i d = c[HeadLanes::kDivisor];
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(q, 32), d),
                                         _mm256_mul_epu32(q, c[HeadLanes::kDivisorHigh]));
  const __m256i qd = _mm256_add_epi64(_mm256_mul_epu32(q, d), _mm256_slli_epi64(cross, 32));
  const __m256i r = _mm256_sub_epi64(n, qd);
  const __m256i correction = _mm256_and_si256(_mm256_cmpgt_epi64(zero, n), c[HeadLanes::kTwo64Mod]);
  // r and the correction are both in [0, d), d < 2^63: r - correction is negative exactly where
  // the scalar's unsigned r < correction holds, and then d brings it back into [0, d).
  const __m256i shifted = _mm256_sub_epi64(r, correction);
  return _mm256_add_epi64(shifted, _mm256_and_si256(_mm256_cmpgt_epi64(zero, shifted), d));
}

template <typename OutT>
QWEN4EXP_TARGET_AVX2 void store_avx2(OutT* row, int64_t col_stride, __m256i ids, int live) {
  if (col_stride != 1) {
    uint64_t lanes[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), ids);
    store_strided(row, col_stride, lanes, live);
    return;
  }
  if constexpr (sizeof(OutT) == 8) {
    if (live == 4) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), ids);
    } else {
      const __m256i mask =
          _mm256_cmpgt_epi64(_mm256_set1_epi64x(live), _mm256_setr_epi64x(0, 1, 2, 3));
      _mm256_maskstore_epi64(reinterpret_cast<long long*>(row), mask, ids);
    }
  } else {
    // The low 32 bits of each lane (the ids fit: the glue checked the offsets), packed.
    const __m128i packed = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(ids, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
    if (live == 4) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row), packed);
    } else {
      const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(live), _mm_setr_epi32(0, 1, 2, 3));
      _mm_maskstore_epi32(reinterpret_cast<int*>(row), mask, packed);
    }
  }
}

template <typename OutT>
QWEN4EXP_TARGET_AVX2 void reduce_avx2(const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens,
                                      OutT* out, int64_t row_stride, int64_t col_stride) {
  for (int first = 0; first < lanes.num_heads(); first += 4) {
    const int live = lanes.num_heads() - first < 4 ? lanes.num_heads() - first : 4;
    __m256i c[HeadLanes::kRows];
    for (int r = 0; r < HeadLanes::kRows; ++r) {
      c[r] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(lanes.row(static_cast<HeadLanes::Row>(r)) + first));
    }
    // Each lane's mix: its slot's 64 bits from the lower or the upper half of the token's eight.
    const __m256i pick = c[HeadLanes::kOrderPair];
    const __m256i upper = c[HeadLanes::kOrderHigh];
    const bool any_upper = _mm256_testz_si256(upper, upper) == 0;
    const __m256i offset = c[HeadLanes::kOffset];
    OutT* column = out + first * col_stride;
    for (int64_t t = 0; t < tokens; ++t) {
      const uint64_t* slots = mixes + t * kMixSlots;
      __m256i mix = _mm256_permutevar8x32_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slots)), pick);
      if (any_upper) {
        const __m256i high = _mm256_permutevar8x32_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slots + 4)), pick);
        mix = _mm256_blendv_epi8(mix, high, upper);
      }
      const __m256i ids = _mm256_add_epi64(floor_mod_avx2(mix, c), offset);
      store_avx2(column + t * row_stride, col_stride, ids, live);
    }
  }
}

// ---- AVX-512: 8 heads a step ----------------------------------------------------------------

QWEN4EXP_TARGET_AVX512 inline __m512i mul_hi_u64_avx512(__m512i a, __m512i a_hi, __m512i b,
                                                        __m512i b_hi) {
  const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFF);
  const __m512i ll = _mm512_mul_epu32(a, b);
  const __m512i lh = _mm512_mul_epu32(a, b_hi);
  const __m512i hl = _mm512_mul_epu32(a_hi, b);
  const __m512i hh = _mm512_mul_epu32(a_hi, b_hi);
  const __m512i mid = _mm512_add_epi64(hl, _mm512_srli_epi64(ll, 32));
  const __m512i mid2 = _mm512_add_epi64(lh, _mm512_and_si512(mid, low32));
  return _mm512_add_epi64(_mm512_add_epi64(hh, _mm512_srli_epi64(mid, 32)),
                          _mm512_srli_epi64(mid2, 32));
}

QWEN4EXP_TARGET_AVX512 inline __m512i floor_mod_avx512(__m512i n, const __m512i* c) {
  const __m512i t1 = mul_hi_u64_avx512(n, _mm512_srli_epi64(n, 32), c[HeadLanes::kMultiplier],
                                       c[HeadLanes::kMultiplierHigh]);
  const __m512i q = _mm512_srlv_epi64(
      _mm512_add_epi64(t1, _mm512_srlv_epi64(_mm512_sub_epi64(n, t1), c[HeadLanes::kShift1])),
      c[HeadLanes::kShift2]);
  const __m512i d = c[HeadLanes::kDivisor];
  const __m512i r = _mm512_sub_epi64(n, _mm512_mullo_epi64(q, d));  // AVX-512DQ
  const __mmask8 negative = _mm512_movepi64_mask(n);
  const __m512i correction = _mm512_maskz_mov_epi64(negative, c[HeadLanes::kTwo64Mod]);
  const __m512i shifted = _mm512_sub_epi64(r, correction);
  return _mm512_mask_add_epi64(shifted, _mm512_cmplt_epu64_mask(r, correction), shifted, d);
}

template <typename OutT>
QWEN4EXP_TARGET_AVX512 void store_avx512(OutT* row, int64_t col_stride, __m512i ids, int live) {
  if (col_stride != 1) {
    uint64_t lanes[8];
    _mm512_storeu_si512(lanes, ids);
    store_strided(row, col_stride, lanes, live);
    return;
  }
  // Masked stores never touch the lanes left out, so a tail needs no scalar loop.
  const __mmask8 mask = static_cast<__mmask8>((1u << live) - 1);
  if constexpr (sizeof(OutT) == 8) {
    _mm512_mask_storeu_epi64(row, mask, ids);
  } else {
    _mm512_mask_cvtepi64_storeu_epi32(row, mask, ids);  // the low 32 bits: the ids fit
  }
}

template <typename OutT>
QWEN4EXP_TARGET_AVX512 void reduce_avx512(const HeadLanes& lanes, const uint64_t* mixes,
                                          int64_t tokens, OutT* out, int64_t row_stride,
                                          int64_t col_stride) {
  for (int first = 0; first < lanes.num_heads(); first += 8) {
    const int live = lanes.num_heads() - first < 8 ? lanes.num_heads() - first : 8;
    __m512i c[HeadLanes::kRows];
    for (int r = 0; r < HeadLanes::kRows; ++r) {
      c[r] = _mm512_loadu_si512(lanes.row(static_cast<HeadLanes::Row>(r)) + first);
    }
    const __m512i pick = c[HeadLanes::kOrder];
    const __m512i offset = c[HeadLanes::kOffset];
    OutT* column = out + first * col_stride;
    for (int64_t t = 0; t < tokens; ++t) {
      const __m512i mix = _mm512_permutexvar_epi64(pick, _mm512_loadu_si512(mixes + t * kMixSlots));
      const __m512i ids = _mm512_add_epi64(floor_mod_avx512(mix, c), offset);
      store_avx512(column + t * row_stride, col_stride, ids, live);
    }
  }
}

#endif  // QWEN4EXP_X86_AVX512

template <typename OutT>
void reduce(int64_t isa, const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens, OutT* out,
            int64_t row_stride, int64_t col_stride) {
#if QWEN4EXP_X86_AVX512
  if (isa == kNgramHashAvx512)
    return reduce_avx512(lanes, mixes, tokens, out, row_stride, col_stride);
  if (isa == kNgramHashAvx2) return reduce_avx2(lanes, mixes, tokens, out, row_stride, col_stride);
#endif
  reduce_scalar(lanes, mixes, tokens, out, row_stride, col_stride);
}

}  // namespace

void reduce_heads(int64_t isa, const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens,
                  int64_t* out, int64_t row_stride, int64_t col_stride) {
  reduce(isa, lanes, mixes, tokens, out, row_stride, col_stride);
}

void reduce_heads(int64_t isa, const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens,
                  int32_t* out, int64_t row_stride, int64_t col_stride) {
  reduce(isa, lanes, mixes, tokens, out, row_stride, col_stride);
}

}  // namespace cpu

namespace {

// set_cpu_ngram_hash_isa's setting; kNgramHashBest: the widest this CPU has.
std::atomic<int64_t> hash_isa_setting{kNgramHashBest};

bool has_hash_isa(int64_t isa) {
  if (isa == kNgramHashScalar) return true;
#if QWEN4EXP_X86_AVX512
  if (isa == kNgramHashAvx2) return simd::cpu_has_avx2();
  if (isa == kNgramHashAvx512) return simd::cpu_has_avx512f_dq();
#endif
  return false;
}

}  // namespace

int64_t cpu_ngram_hash_isa() {
  const int64_t set = hash_isa_setting.load(std::memory_order_relaxed);
  if (set != kNgramHashBest) return set;
  if (has_hash_isa(kNgramHashAvx512)) return kNgramHashAvx512;
  if (has_hash_isa(kNgramHashAvx2)) return kNgramHashAvx2;
  return kNgramHashScalar;
}

int64_t set_cpu_ngram_hash_isa(int64_t isa) {
  if (isa < kNgramHashBest || isa > kNgramHashAvx512) {
    throw std::invalid_argument(
        "set_cpu_ngram_hash_isa: isa must be -1 (the widest), 0 (scalar), 1 (avx2) or 2 "
        "(avx512), got " +
        std::to_string(isa));
  }
  if (isa != kNgramHashBest && !has_hash_isa(isa)) {
    throw std::invalid_argument(
        std::string("set_cpu_ngram_hash_isa: the ") +
        (isa == kNgramHashAvx2 ? "avx2 hash needs AVX2" : "avx512 hash needs AVX-512F and DQ") +
        ", which this CPU or build lacks");
  }
  return hash_isa_setting.exchange(isa);
}

}  // namespace qwen4exp
