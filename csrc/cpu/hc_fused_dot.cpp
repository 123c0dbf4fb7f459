// The skinny products of the fused hyper-connection projections (hc_fused_dot.h). A file of its
// own because it wants what hc_fused.cpp forbids: a·b+c contracted into an FMA (the x86-64-v3/v4
// clones' vfmadd). The dot's summation order is ours either way (vLLM's is the vendor BLAS's),
// so contraction changes no stated rounding point; the epilogues, whose order is vLLM's, stay in
// hc_fused.cpp under fp-contract=off.
//
// Register blocking: 4 weight rows × up to 4 tokens, 16 vector accumulators, so each 8-wide load
// of a weight row feeds 4 FMAs and each load of an activation row 4 more. A short last tile of
// rows repeats its last row and discards it; a short last tile of tokens has its own unrolling.
#include "hc_fused_dot.h"

#include <algorithm>
#include <stdexcept>

#include "simd.h"

namespace qwen4exp::cpu {
namespace {

using simd::f32x8;

constexpr int kRows = 4;
constexpr int kTokens = 4;

QWEN4EXP_ALWAYS_INLINE float lane_sum(f32x8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// The dots of kTok tokens (from `at`) with every row.
template <typename W, int kTok>
QWEN4EXP_ALWAYS_INLINE void dot_tile(const float* const* at, const W* w, int64_t w_stride,
                                     int64_t rows, int64_t depth, float* out,
                                     int64_t out_stride) {
  const int64_t whole = depth / simd::kLanes * simd::kLanes;
  const int tail = static_cast<int>(depth - whole);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const W* wr[kRows];
    for (int i = 0; i < kRows; ++i) wr[i] = w + std::min(r0 + i, rows - 1) * w_stride;
    f32x8 acc[kRows][kTok];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kTok; ++j) acc[i][j] = simd::splat(0.f);
    const auto step = [&](int64_t k, int n) QWEN4EXP_LAMBDA_INLINE {
      f32x8 wv[kRows];
      for (int i = 0; i < kRows; ++i) wv[i] = simd::load_n(wr[i] + k, n);
      for (int j = 0; j < kTok; ++j) {
        const f32x8 av = simd::load(at[j] + k);  // zero past depth
        for (int i = 0; i < kRows; ++i) acc[i][j] += wv[i] * av;
      }
    };
    for (int64_t k = 0; k < whole; k += simd::kLanes) step(k, simd::kLanes);
    if (tail > 0) step(whole, tail);
    for (int j = 0; j < kTok; ++j) {
      for (int i = 0; i < kRows && r0 + i < rows; ++i) {
        out[j * out_stride + r0 + i] = lane_sum(acc[i][j]);
      }
    }
  }
}

// Tiles of 4 tokens, the last one of 1..3 (no wasted products at T = 1: decode's common case).
template <typename W>
QWEN4EXP_ALWAYS_INLINE void dot_rows_body(const float* a, int64_t a_stride, int64_t tokens,
                                          const W* w, int64_t w_stride, int64_t rows,
                                          int64_t depth, float* out, int64_t out_stride) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const float* at[kTokens];
    for (int j = 0; j < kTokens; ++j) at[j] = a + std::min(t0 + j, tokens - 1) * a_stride;
    float* o = out + t0 * out_stride;
    switch (std::min<int64_t>(kTokens, tokens - t0)) {
      case 1:
        dot_tile<W, 1>(at, w, w_stride, rows, depth, o, out_stride);
        break;
      case 2:
        dot_tile<W, 2>(at, w, w_stride, rows, depth, o, out_stride);
        break;
      case 3:
        dot_tile<W, 3>(at, w, w_stride, rows, depth, o, out_stride);
        break;
      default:
        dot_tile<W, kTokens>(at, w, w_stride, rows, depth, o, out_stride);
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

}  // namespace

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
