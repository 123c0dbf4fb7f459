// CPU kernels for the hyper-connection combine and norms (csrc/common/hc_norm.h, issue #50):
// hc_combine, hc_combine_norm and grouped_gemma_rmsnorm.
//
// Parallel over tokens (rows). hc_combine_norm does one stream of a token in two sweeps: the
// first computes h = round(residual + block·injection), stores it and sums its squares; the second
// reads h back (from L1: H elements) and writes the norm. Every input is read from memory once.
//
// The sums reproduce what vLLM's Triton kernels sum, in the order Triton's interpreter sums
// them (numpy_sum.h): grouped_gemma_rmsnorm one block of next_pow2(G) elements; hc_combine_norm
// tiles of 512 (its BLOCK_SIZE), each pairwise, then the next_pow2(tiles) tile sums (the padded
// ones zero) as numpy sums a short row. The rest is element-wise in vLLM's expression order, so
// fp16 results equal the kernels run by the interpreter but where its exp or 1/sqrt differ from
// ours in the last fp32 bit (tests/hc_combine_norm/ measures it).
//
// Rows are walked in simd.h's blocks of 16 (16-bit rows split into even and odd elements); the
// norm weights are laid out to match (simd::block_slot), the sums keep numpy's lanes apart.

// Parity needs every product rounded before it is added, as Triton's interpreter computes: no
// a*b+c contracted into an FMA in the AVX2/AVX-512 clones (see ple_gate.cpp).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "../common/dispatch.h"
#include "../common/hc_norm.h"
#include "numpy_sum.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

using numpy_order::kPairwiseLeaf;
using simd::f32x8;
using simd::load_n;
using simd::splat;

// hc_combine_norm's BLOCK_SIZE in vLLM: its sum of squares is per tile of this many elements.
constexpr int kTile = 512;
constexpr int kLeavesPerTile = kTile / kPairwiseLeaf;

// The norm weights as fp32, each row of `width` in the block layout of activation type A.
template <typename A, typename W>
std::vector<float> weights_in_block_layout(const void* weight, int64_t count, int width) {
  std::vector<float> out(count);
  const W* w = static_cast<const W*>(weight);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t j = c % width;
    out[c - j + simd::block_slot<A>(j, width)] = to_float(w[c]);
  }
  return out;
}

template <typename A>
std::vector<float> norm_weights(const void* weight, Dtype weight_dtype, int64_t count, int width) {
  return dispatch_dtype(
      kFloatDtypes, weight_dtype,
      [&](auto w) {
        return weights_in_block_layout<A, typename decltype(w)::type>(weight, count, width);
      },
      []() -> std::vector<float> {
        throw std::invalid_argument("hc norm: no CPU kernel for this weight dtype");
      });
}

// dst = the Gemma norm of the n elements of src (T): y = x·rrms; y += y·w.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void gemma_scale(const T* src, const float* w, T* dst, int n, float rrms) {
  const f32x8 r = splat(rrms);
  simd::for_each_block(0, n, [&](int i, auto step) QWEN4EXP_LAMBDA_INLINE {
    const auto y = load_n(src + i, step) * r;
    simd::store_n(dst + i, y + y * load_n(w + i, step), step);
  });
}

// x rounded to T, stored at p (a block, or n elements) and returned as stored. A bf16 value
// rounded already has a zero low half, which the store's own rounding leaves as it is: it skips
// the NaN test (simd::NaNs).
template <typename T, typename X, typename Step>
QWEN4EXP_ALWAYS_INLINE X round_and_store(T* p, X x, Step n) {
  const X rounded = simd::round<T>(x);
  if constexpr (std::is_same_v<T, bf16_t>) {
    simd::store_n<simd::NaNs::kLowHalfZero>(p, rounded, n);
  } else {
    simd::store_n(p, rounded, n);
  }
  return rounded;
}

template <typename T, bool kNorm>
QWEN4EXP_ALWAYS_INLINE void combine_rows(const HcCombineParams& p, const float* w, int64_t begin,
                                         int64_t end) {
  const int H = p.width;
  const float hc = static_cast<float>(p.streams);
  const float h_f = static_cast<float>(H);
  const int num_leaves = (H + kPairwiseLeaf - 1) / kPairwiseLeaf;
  const int tiles = (H + kTile - 1) / kTile;
  int padded_tiles = 1;
  while (padded_tiles < tiles) padded_tiles *= 2;
  std::vector<float> buf(num_leaves + padded_tiles, 0.f);
  float* leaves = buf.data();
  float* tile_sums = leaves + num_leaves;
  for (int64_t t = begin; t < end; ++t) {
    const T* residual = static_cast<const T*>(p.residual) + t * p.residual_row_stride;
    const T* block = static_cast<const T*>(p.block_output) + t * p.block_row_stride;
    const T* logits = p.injection_logits == nullptr
                          ? nullptr
                          : static_cast<const T*>(p.injection_logits) + t * p.logits_row_stride;
    T* h = static_cast<T*>(p.h) + t * p.h_row_stride;
    for (int s = 0; s < p.streams; ++s) {
      const int64_t base = static_cast<int64_t>(s) * H;
      // No logits (vLLM's NVIDIA module): block·1, the block output itself.
      const f32x8 injection =
          splat(logits != nullptr ? 2.0f * sigmoid_f32(to_float(logits[s]) / hc) : 1.0f);
      const T* r = residual + base;
      T* out = h + base;
      T* xn = kNorm ? static_cast<T*>(p.xn) + t * p.xn_row_stride + base : nullptr;
      if constexpr (!kNorm) {
        simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
          simd::store_n(out + i, load_n(r + i, n) + load_n(block + i, n) * injection, n);
        });
      } else {
        for (int b = 0; b < num_leaves; ++b) {
          f32x8 lanes = splat(0.f);
          const int leaf_end = std::min(H, (b + 1) * kPairwiseLeaf);
          simd::for_each_block(
              b * kPairwiseLeaf, leaf_end, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
                const auto x = round_and_store(
                    out + i, load_n(r + i, n) + load_n(block + i, n) * injection, n);
                numpy_order::add_in_numpy_lanes<T>(lanes, x * x);
              });
          leaves[b] = numpy_order::fold_lanes<T>(lanes);
        }
        for (int k = 0; k < tiles; ++k) {
          tile_sums[k] =
              numpy_order::fold_leaves(leaves + k * kLeavesPerTile,
                                       std::min(kLeavesPerTile, num_leaves - k * kLeavesPerTile));
        }
        const float sum_sq = numpy_order::pairwise_sum(tile_sums, padded_tiles);  // padding: 0
        const float rrms = 1.0f / std::sqrt(sum_sq / h_f + p.eps);
        gemma_scale<T>(out, w + (p.weight_shared ? 0 : base), xn, H, rrms);
      }
    }
  }
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE void rmsnorm_rows(const HcRmsNormParams& p, const float* w, int64_t begin,
                                         int64_t end) {
  const int G = p.width;
  const float g_f = static_cast<float>(G);
  std::vector<float> leaf_buf(G / kPairwiseLeaf + 1);
  float* leaves = leaf_buf.data();
  for (int64_t row = begin; row < end; ++row) {
    const T* x_row = static_cast<const T*>(p.x) + row * p.x_row_stride;
    T* y_row = static_cast<T*>(p.y) + row * p.y_row_stride;
    for (int g = 0; g < p.groups; ++g) {
      const int64_t base = static_cast<int64_t>(g) * G;
      const T* x = x_row + base;
      // numpy's order over vLLM's block of next_pow2(G), the padding zero (numpy_sum.h).
      const float sum_sq = numpy_order::numpy_sum<T>(
          G,
          [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
            const auto v = load_n(x + i, n);
            return v * v;
          },
          leaves);
      const float rrms = 1.0f / std::sqrt(sum_sq / g_f + p.eps);
      gemma_scale<T>(x, w + (p.weight_shared ? 0 : base), y_row + base, G, rrms);
    }
  }
}

// One non-template entry per dtype and variant, each compiled for three instruction sets.
#define QWEN4EXP_HC_COMBINE_ENTRY(NAME, T, NORM)                                                  \
  QWEN4EXP_CPU_CLONES void NAME(const HcCombineParams& p, const float* w, int64_t b, int64_t e) { \
    combine_rows<T, NORM>(p, w, b, e);                                                            \
  }
QWEN4EXP_HC_COMBINE_ENTRY(combine_f32, float, false)
QWEN4EXP_HC_COMBINE_ENTRY(combine_bf16, bf16_t, false)
QWEN4EXP_HC_COMBINE_ENTRY(combine_f16, f16_t, false)
QWEN4EXP_HC_COMBINE_ENTRY(combine_norm_f32, float, true)
QWEN4EXP_HC_COMBINE_ENTRY(combine_norm_bf16, bf16_t, true)
QWEN4EXP_HC_COMBINE_ENTRY(combine_norm_f16, f16_t, true)
#undef QWEN4EXP_HC_COMBINE_ENTRY

#define QWEN4EXP_HC_RMSNORM_ENTRY(NAME, T)                                                        \
  QWEN4EXP_CPU_CLONES void NAME(const HcRmsNormParams& p, const float* w, int64_t b, int64_t e) { \
    rmsnorm_rows<T>(p, w, b, e);                                                                  \
  }
QWEN4EXP_HC_RMSNORM_ENTRY(rmsnorm_f32, float)
QWEN4EXP_HC_RMSNORM_ENTRY(rmsnorm_bf16, bf16_t)
QWEN4EXP_HC_RMSNORM_ENTRY(rmsnorm_f16, f16_t)
#undef QWEN4EXP_HC_RMSNORM_ENTRY

// Rows per thread: a few rows of some thousand elements already fill one.
int64_t grain_for(int64_t elements_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elements_per_row));
}

}  // namespace

void run_hc_combine_cpu(const HcCombineParams& p) {
  if (p.num_tokens == 0) return;
  const bool norm = p.xn != nullptr;
  using Rows = void (*)(const HcCombineParams&, const float*, int64_t, int64_t);
  std::vector<float> w;
  const Rows rows = dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto dtype) -> Rows {
        using T = typename decltype(dtype)::type;
        if (norm) {
          w = norm_weights<T>(p.norm_weight, p.weight_dtype,
                              p.weight_shared ? p.width : int64_t{p.width} * p.streams, p.width);
        }
        if constexpr (std::is_same_v<T, float>) {
          return norm ? combine_norm_f32 : combine_f32;
        }
        if constexpr (std::is_same_v<T, bf16_t>) {
          return norm ? combine_norm_bf16 : combine_bf16;
        }
        return norm ? combine_norm_f16 : combine_f16;
      },
      []() -> Rows { throw std::invalid_argument("hc_combine: no CPU kernel for this dtype"); });
  cpu::parallel_for(0, p.num_tokens, grain_for(int64_t{p.width} * p.streams),
                    [&](int64_t begin, int64_t end) { rows(p, w.data(), begin, end); });
}

void run_hc_rmsnorm_cpu(const HcRmsNormParams& p) {
  if (p.num_rows == 0) return;
  using Rows = void (*)(const HcRmsNormParams&, const float*, int64_t, int64_t);
  std::vector<float> w;
  const Rows rows = dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto dtype) -> Rows {
        using T = typename decltype(dtype)::type;
        w = norm_weights<T>(p.weight, p.weight_dtype,
                            p.weight_shared ? p.width : int64_t{p.width} * p.groups, p.width);
        if constexpr (std::is_same_v<T, float>) return rmsnorm_f32;
        if constexpr (std::is_same_v<T, bf16_t>) return rmsnorm_bf16;
        return rmsnorm_f16;
      },
      []() -> Rows {
        throw std::invalid_argument("grouped_gemma_rmsnorm: no CPU kernel for this dtype");
      });
  cpu::parallel_for(0, p.num_rows, grain_for(int64_t{p.width} * p.groups),
                    [&](int64_t begin, int64_t end) { rows(p, w.data(), begin, end); });
}

}  // namespace qwen4exp
