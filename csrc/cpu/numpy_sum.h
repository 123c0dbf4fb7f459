// numpy's pairwise summation order (the order Triton's interpreter sums a block in, np.sum), on
// simd.h's eight-lane vectors: what makes the CPU kernels that reproduce vLLM's Triton kernels
// (ple_gate's "vllm" rounding, the hyper-connection norms) equal them bit for bit. Shared by
// csrc/cpu/ple_gate.cpp and csrc/cpu/hc_norm.cpp; an includer compiles with fp-contract off.
//
// numpy sums n elements as: n < 8, one running sum from 0; n <= 128 (PW_BLOCKSIZE), eight lane
// accumulators r0..r7 (lane j the elements j mod 8, in order) folded as
// ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the elements past the last multiple of 8 added one
// by one; else the two halves (the first n/2 rounded down to a multiple of 8) each so, then added.
#pragma once

#include <algorithm>
#include <array>

#include "simd.h"

namespace qwen4exp {
namespace numpy_order {

using simd::f32x8;
using simd::kLanes;
constexpr int kPairwiseLeaf = 128;  // numpy's PW_BLOCKSIZE

// The pairwise sums keep numpy's eight lane accumulators r0..r7 (lane j sums the elements j mod 8,
// in order) in one f32x8. For T whose blocks split even and odd elements the accumulator holds them
// as r0 r2 r4 r6 r1 r3 r5 r7, the order in which a split block's halves deliver them: its first 8
// elements are lo's lanes 0-3 and hi's lanes 0-3, the next 8 the upper lanes.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void add_in_numpy_lanes(f32x8& r, simd::f32x16 t) {
  if constexpr (simd::kSplitsEvenOdd<T>) {
    r += __builtin_shufflevector(t.lo, t.hi, 0, 1, 2, 3, 8, 9, 10, 11);
    r += __builtin_shufflevector(t.lo, t.hi, 4, 5, 6, 7, 12, 13, 14, 15);
  } else {
    r += t.lo;
    r += t.hi;
  }
}
template <typename T>
QWEN4EXP_ALWAYS_INLINE void add_in_numpy_lanes(f32x8& r, f32x8 t) {  // 8 elements in order
  if constexpr (simd::kSplitsEvenOdd<T>) {
    r += __builtin_shufflevector(t, t, 0, 2, 4, 6, 1, 3, 5, 7);
  } else {
    r += t;
  }
}

// ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)): how numpy folds its eight lane accumulators.
template <typename T>
QWEN4EXP_ALWAYS_INLINE float fold_lanes(f32x8 acc) {
  const auto r = [&](int j) { return acc[simd::kSplitsEvenOdd<T> ? (j % 2) * 4 + j / 2 : j]; };
  return ((r(0) + r(1)) + (r(2) + r(3))) + ((r(4) + r(5)) + (r(6) + r(7)));
}

// Combines leaf sums pairwise up a binary tree. Leaves past the end are all zero in the padded
// tree, and a pair whose right half is zero is its left half.
QWEN4EXP_ALWAYS_INLINE float fold_leaves(float* leaves, int count) {
  for (; count > 1; count = (count + 1) / 2) {
    for (int i = 0; i < count / 2; ++i) leaves[i] = leaves[2 * i] + leaves[2 * i + 1];
    if (count & 1) leaves[count / 2] = leaves[count - 1];
  }
  return leaves[0];
}

// Σ terms(i, step)[s] over i < n, for each of the N sums s, in numpy's pairwise order over the
// zero-padded power-of-two block (see the file comment); summed side by side in one sweep so
// that the rows they read stream from memory together. terms returns, for simd::for_each_block's
// step at i, N f32x16 of a whole block or N f32x8 of `step` elements in order (the lanes past it
// zero). leaves holds N * (n / kPairwiseLeaf + 1) floats. n >= 5 (see sequential_sums).
template <typename T, size_t N, typename Terms>
QWEN4EXP_ALWAYS_INLINE std::array<float, N> pairwise_sums(int n, const Terms& terms,
                                                          float* leaves) {
  const int num_leaves = (n + kPairwiseLeaf - 1) / kPairwiseLeaf;
  for (int b = 0; b < num_leaves; ++b) {
    const int end = std::min(n, (b + 1) * kPairwiseLeaf);
    std::array<f32x8, N> r;
    r.fill(simd::splat(0.0f));
    simd::for_each_block(b * kPairwiseLeaf, end, [&](int i, auto step) QWEN4EXP_LAMBDA_INLINE {
      const auto t = terms(i, step);
      for (size_t s = 0; s < N; ++s) add_in_numpy_lanes<T>(r[s], t[s]);
    });
    for (size_t s = 0; s < N; ++s) leaves[s * num_leaves + b] = fold_lanes<T>(r[s]);
  }
  std::array<float, N> sums;
  for (size_t s = 0; s < N; ++s) sums[s] = fold_leaves(leaves + s * num_leaves, num_leaves);
  return sums;
}

// numpy's order for blocks shorter than 8 (H <= 4): one running sum from 0.
template <size_t N, typename Terms>
QWEN4EXP_ALWAYS_INLINE std::array<float, N> sequential_sums(int n, const Terms& terms) {
  const auto t = terms(0, n);
  std::array<float, N> sums;
  for (size_t s = 0; s < N; ++s) {
    sums[s] = 0.f;
    for (int i = 0; i < n; ++i) sums[s] += t[s][i];
  }
  return sums;
}

template <typename T, size_t N, typename Terms>
QWEN4EXP_ALWAYS_INLINE std::array<float, N> numpy_sums(int n, const Terms& terms, float* leaves) {
  return n <= 4 ? sequential_sums<N>(n, terms) : pairwise_sums<T, N>(n, terms, leaves);
}

// One sum: terms returns the f32x16 or f32x8 itself.
template <typename T, typename Terms>
QWEN4EXP_ALWAYS_INLINE float numpy_sum(int n, const Terms& terms, float* leaves) {
  const auto one = [&](int i, auto step)
                       QWEN4EXP_LAMBDA_INLINE { return std::array{terms(i, step)}; };
  return numpy_sums<T, 1>(n, one, leaves)[0];
}

// numpy's sum of n (< 2^31) plain floats, exactly as numpy orders it (see the file comment).
inline float pairwise_sum(const float* a, int n) {
  if (n < 8) {
    float res = 0.f;
    for (int i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= kPairwiseLeaf) {
    float r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int i = 8;
    for (; i < n - n % 8; i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

}  // namespace numpy_order
}  // namespace qwen4exp
