// The skinny products of the fused hyper-connection projections (hc_fused_dot.h). A file of its
// own because it wants what hc_fused.cpp forbids: a·b+c contracted into an FMA (the x86-64-v3/v4
// clones' vfmadd). The dot's summation order is ours either way (vLLM's is the vendor BLAS's),
// so contraction changes no stated rounding point; the epilogues, whose order is vLLM's, stay in
// hc_fused.cpp under fp-contract=off.
//
// Register blocking: 4 weight rows × up to 4 tokens, 16 vector accumulators, so each 16-wide load
// of a weight row feeds 4 FMAs and each load of an activation row 4 more. A short last tile of
// rows repeats its last row and discards it; a short last tile of tokens has its own unrolling.
#include "hc_fused_dot.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <stdexcept>

#include "../common/hc_fused.h"
#include "simd.h"

namespace qwen4exp::cpu {
namespace {

// 16 fp32 lanes: one zmm register in the x86-64-v4 clone (Zen 4's AVX-512: half the instructions
// of simd.h's 8-wide vectors for the same products), two ymm or four xmm in the others.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kLanes = kDotLanes;
constexpr int kRows = 4;
constexpr int kTokens = 4;
static_assert(kRows * kTokens == 16, "a tile's dots are one pass of lane_sums");

QWEN4EXP_ALWAYS_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
QWEN4EXP_ALWAYS_INLINE f32x16 load16(const bf16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}
QWEN4EXP_ALWAYS_INLINE f32x16 load16(const f16_t* p) {
  const simd::f32x8 lo = simd::load(p), hi = simd::load(p + 8);
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// The first n (< 16) elements, zeros after them.
template <typename W>
QWEN4EXP_ALWAYS_INLINE f32x16 load16_partial(const W* p, int n) {
  W tmp[kLanes];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, sizeof(W) * n);
  return load16(tmp);
}

// The lane sums of 16 vectors at once: out[n] = the sum of v[n]'s 16 lanes, by the same tree for
// every n (lane i + lane i+8, then i + i+4, i + i+2, i + i+1) whichever vectors share the pass:
// each shuffle only sets two vectors' partial sums side by side, and each add adds one vector's
// own lanes. 15 adds and 30 shuffles for 16 dots, where one sum at a time is some 15 operations
// each (the up projection's rows are short: R = 320 is 20 steps, the sums no small part).
QWEN4EXP_ALWAYS_INLINE void lane_sums(const f32x16 (&v)[16], float (&out)[16]) {
  f32x16 u[8], w[4], z[2];
  for (int p = 0; p < 8; ++p) {
    const f32x16 a = v[2 * p], b = v[2 * p + 1];
    u[p] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int q = 0; q < 4; ++q) {
    const f32x16 a = u[2 * q], b = u[2 * q + 1];
    w[q] =
        __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
        __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int r = 0; r < 2; ++r) {
    const f32x16 a = w[2 * r], b = w[2 * r + 1];
    z[r] =
        __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
        __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  const f32x16 sums = __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26,
                                              12, 28, 14, 30) +
                      __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27,
                                              13, 29, 15, 31);
  // Lane L holds the sum of vector kOwner[L] (the passes' pairings, bit-reversed).
  constexpr int kOwner[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int lane = 0; lane < 16; ++lane) out[kOwner[lane]] = sums[lane];
}

// The dots of kTok tokens (from `at`) with every row.
template <typename W, int kTok>
QWEN4EXP_ALWAYS_INLINE void dot_tile(const float* const* at, const W* w, int64_t w_stride,
                                     int64_t rows, int64_t depth, float* out, int64_t out_stride) {
  const int64_t whole = depth / kLanes * kLanes;
  const int tail = static_cast<int>(depth - whole);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const W* wr[kRows];
    for (int i = 0; i < kRows; ++i) wr[i] = w + std::min(r0 + i, rows - 1) * w_stride;
    f32x16 acc[kRows][kTok];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kTok; ++j) acc[i][j] = f32x16{};
    const auto step = [&](const f32x16(&wv)[kRows], int64_t k) QWEN4EXP_LAMBDA_INLINE {
      for (int j = 0; j < kTok; ++j) {
        const f32x16 av = load16(at[j] + k);  // zero past depth
        for (int i = 0; i < kRows; ++i) acc[i][j] += wv[i] * av;
      }
    };
    for (int64_t k = 0; k < whole; k += kLanes) {
      f32x16 wv[kRows];
      for (int i = 0; i < kRows; ++i) wv[i] = load16(wr[i] + k);
      step(wv, k);
    }
    if (tail > 0) {
      f32x16 wv[kRows];
      for (int i = 0; i < kRows; ++i) wv[i] = load16_partial(wr[i] + whole, tail);
      step(wv, whole);
    }
    f32x16 all[16] = {};
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kTok; ++j) all[j * kRows + i] = acc[i][j];
    float sums[16];
    lane_sums(all, sums);
    for (int j = 0; j < kTok; ++j) {
      for (int i = 0; i < kRows && r0 + i < rows; ++i) {
        out[j * out_stride + r0 + i] = sums[j * kRows + i];
      }
    }
  }
}

// Tiles of 4 tokens, the last one of 1..3 (no wasted products at T = 1: decode's common case).
template <typename W>
QWEN4EXP_ALWAYS_INLINE void dot_rows_body(const float* a, int64_t a_stride, int64_t tokens,
                                          const W* w, int64_t w_stride, int64_t rows, int64_t depth,
                                          float* out, int64_t out_stride) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const float* at[kTokens];
    for (int j = 0; j < kTokens; ++j) at[j] = a + std::min(t0 + j, tokens - 1) * a_stride;
    float* o = out + t0 * out_stride;
    switch (std::min<int64_t>(kTokens, tokens - t0)) {
      case 1: dot_tile<W, 1>(at, w, w_stride, rows, depth, o, out_stride); break;
      case 2: dot_tile<W, 2>(at, w, w_stride, rows, depth, o, out_stride); break;
      case 3: dot_tile<W, 3>(at, w, w_stride, rows, depth, o, out_stride); break;
      default: dot_tile<W, kTokens>(at, w, w_stride, rows, depth, o, out_stride);
    }
  }
}

#define QWEN4EXP_DOT_ENTRY(NAME, W)                                                              \
  QWEN4EXP_CPU_CLONES void NAME(const float* a, int64_t a_stride, int64_t tokens, const void* w, \
                                int64_t w_stride, int64_t rows, int64_t depth, float* out,       \
                                int64_t out_stride) {                                            \
    dot_rows_body<W>(a, a_stride, tokens, static_cast<const W*>(w), w_stride, rows, depth, out,  \
                     out_stride);                                                                \
  }
QWEN4EXP_DOT_ENTRY(dot_rows_f32, float)
QWEN4EXP_DOT_ENTRY(dot_rows_bf16, bf16_t)
QWEN4EXP_DOT_ENTRY(dot_rows_f16, f16_t)
#undef QWEN4EXP_DOT_ENTRY

#if QWEN4EXP_X86_AVX512
#define QWEN4EXP_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

template <int kTok>
QWEN4EXP_TARGET_BF16 void bf16_tile(const bf16_t* const* at, const bf16_t* w, int64_t w_stride,
                                    int64_t rows, int64_t depth, float* out, int64_t out_stride) {
  const int64_t whole = depth / kBf16DotLanes * kBf16DotLanes;
  const int tail = static_cast<int>(depth - whole);
  const __mmask32 tail_mask = tail > 0 ? (__mmask32{1} << tail) - 1 : 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const bf16_t* wr[kRows];
    for (int i = 0; i < kRows; ++i) wr[i] = w + std::min(r0 + i, rows - 1) * w_stride;
    __m512 acc[kRows][kTok];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kTok; ++j) acc[i][j] = _mm512_setzero_ps();
    // No lambda for the step: a lambda does not take this function's target attribute.
    for (int64_t k = 0; k < whole + (tail > 0 ? kBf16DotLanes : 0); k += kBf16DotLanes) {
      __m512bh wv[kRows];
      for (int i = 0; i < kRows; ++i) {
        wv[i] = k < whole ? (__m512bh)_mm512_loadu_si512(wr[i] + k)
                          : (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, wr[i] + k);
      }
      for (int j = 0; j < kTok; ++j) {
        const __m512bh av = (__m512bh)_mm512_loadu_si512(at[j] + k);  // zero past depth
        for (int i = 0; i < kRows; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], av);
      }
    }
    f32x16 all[16] = {};
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kTok; ++j) all[j * kRows + i] = (f32x16)acc[i][j];
    float sums[16];
    lane_sums(all, sums);
    for (int j = 0; j < kTok; ++j) {
      for (int i = 0; i < kRows && r0 + i < rows; ++i) {
        out[j * out_stride + r0 + i] = sums[j * kRows + i];
      }
    }
  }
}
#endif

}  // namespace

bool has_bf16_dot() {
#if QWEN4EXP_X86_AVX512
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

namespace {
std::atomic<int64_t> dot_setting{-1};
}  // namespace

bool use_bf16_dot() {
  const int64_t set = dot_setting.load(std::memory_order_relaxed);
  return set < 0 ? has_bf16_dot() : set == 1;
}

void dot_rows_bf16(const bf16_t* a, int64_t a_stride, int64_t tokens, const bf16_t* w,
                   int64_t w_stride, int64_t rows, int64_t depth, float* out, int64_t out_stride) {
#if QWEN4EXP_X86_AVX512
  if (!has_bf16_dot()) throw std::logic_error("dot_rows_bf16: no AVX512-BF16 on this CPU");
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const bf16_t* at[kTokens];
    for (int j = 0; j < kTokens; ++j) at[j] = a + std::min(t0 + j, tokens - 1) * a_stride;
    float* o = out + t0 * out_stride;
    switch (std::min<int64_t>(kTokens, tokens - t0)) {
      case 1: bf16_tile<1>(at, w, w_stride, rows, depth, o, out_stride); break;
      case 2: bf16_tile<2>(at, w, w_stride, rows, depth, o, out_stride); break;
      case 3: bf16_tile<3>(at, w, w_stride, rows, depth, o, out_stride); break;
      default: bf16_tile<kTokens>(at, w, w_stride, rows, depth, o, out_stride);
    }
  }
#else
  (void)a, (void)a_stride, (void)tokens, (void)w, (void)w_stride, (void)rows, (void)depth,
      (void)out, (void)out_stride;
  throw std::logic_error("dot_rows_bf16: no AVX512-BF16 on this CPU");
#endif
}

void dot_rows(const float* a, int64_t a_stride, int64_t tokens, const void* w, int64_t w_stride,
              Dtype w_dtype, int64_t rows, int64_t depth, float* out, int64_t out_stride) {
  if (tokens <= 0 || rows <= 0) return;
  switch (w_dtype) {
    case Dtype::kF32:
      return dot_rows_f32(a, a_stride, tokens, w, w_stride, rows, depth, out, out_stride);
    case Dtype::kBF16:
      return dot_rows_bf16(a, a_stride, tokens, w, w_stride, rows, depth, out, out_stride);
    case Dtype::kF16:
      return dot_rows_f16(a, a_stride, tokens, w, w_stride, rows, depth, out, out_stride);
    default:
      throw std::invalid_argument("hc fused projections: no CPU kernel for this weight dtype");
  }
}

}  // namespace qwen4exp::cpu

namespace qwen4exp {

int64_t cpu_hc_dot() { return cpu::use_bf16_dot() ? 1 : 0; }

int64_t set_cpu_hc_dot(int64_t dot) {
  if (dot < -1 || dot > 1) {
    throw std::invalid_argument(
        "set_cpu_hc_dot: dot must be -1 (the default), 0 (fp32) or 1 (bf16), got " +
        std::to_string(dot));
  }
  if (dot == 1 && !cpu::has_bf16_dot()) {
    throw std::invalid_argument(
        "set_cpu_hc_dot: the bf16 dot needs AVX512-BF16, which this CPU or build lacks");
  }
  return cpu::dot_setting.exchange(dot);
}

}  // namespace qwen4exp
