// CPU kernels for the hyper-connection mixes (csrc/common/hc_mix.h, issue #50): hc_gate_mix and
// hc_silu. Element-wise, parallel over tokens, in simd.h's blocks; the sigmoid is 1 / (1 +
// exp(-z)), of a 16-bit gate looked up (exact: the GPU kernels' value), else with simd.h's
// vectorised exp (~1 ulp: the results can differ from vLLM's kernels, and from the GPU's
// correctly rounded exp, by a unit in the last place of their dtype where the fp32 value lands
// next to a rounding boundary; testing.TOLERANCES states the tolerance).
// gate_mix sums the streams in fp32 from 0 in stream order, then divides by HC, as vLLM does.

// No a*b+c contracted into an FMA: vLLM's order of roundings (see ple_gate.cpp).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "../common/dispatch.h"
#include "../common/hc_mix.h"
#include "hc_sigmoid_table.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

using simd::f32x16;
using simd::f32x8;
using simd::load_n;

QWEN4EXP_ALWAYS_INLINE f32x8 sigmoid(f32x8 z) { return 1.0f / (1.0f + simd::exp_poly(-z)); }
QWEN4EXP_ALWAYS_INLINE f32x16 sigmoid(f32x16 z) { return {sigmoid(z.lo), sigmoid(z.hi)}; }
QWEN4EXP_ALWAYS_INLINE f32x8 divide(f32x8 a, float d) { return a / d; }
QWEN4EXP_ALWAYS_INLINE f32x16 divide(f32x16 a, float d) { return {a.lo / d, a.hi / d}; }
QWEN4EXP_ALWAYS_INLINE f32x8 zero_like(f32x8) { return simd::splat(0.f); }
QWEN4EXP_ALWAYS_INLINE f32x16 zero_like(f32x16) { return {simd::splat(0.f), simd::splat(0.f)}; }

using cpu::sigmoid_table;  // hc_sigmoid_table.h: the gates of a 16-bit gate_mix are looked up

// The table's sigmoids of a block of 16-bit gates, in simd.h's even/odd split of the block; or
// of a tail step's n (<= 8) gates in order, the lanes past n 0.
QWEN4EXP_ALWAYS_INLINE f32x16 lookup(const float* table, const uint16_t* g, simd::Block16) {
  f32x16 out;
  for (int j = 0; j < simd::kLanes; ++j) {
    out.lo[j] = table[g[2 * j]];
    out.hi[j] = table[g[2 * j + 1]];
  }
  return out;
}
QWEN4EXP_ALWAYS_INLINE f32x8 lookup(const float* table, const uint16_t* g, int n) {
  f32x8 out = simd::splat(0.f);
  for (int j = 0; j < n; ++j) out[j] = table[g[j]];
  return out;
}

// A token reads 2·HC streams of H elements at once (x and gate at s·H + i), each a few KiB that
// start afresh at the next token: the hardware's stream prefetchers retrain every token and stop
// at page boundaries, so a bf16 prefill (T = 8192, H = 2560, HC = 4) spent half its time waiting
// on DRAM: 5.0 us a token against 2.6 with its rows in cache (Zen 4, 1 thread). So each whole
// block fetches the next token's lines at its own offsets: 3.7 us a token.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void gate_mix_rows(const HcGateMixParams& p, int64_t begin, int64_t end) {
  const int H = p.width;
  const float hc = static_cast<float>(p.streams);
  [[maybe_unused]] const float* table = nullptr;
  if constexpr (sizeof(T) == 2) table = sigmoid_table<T>();
  constexpr int kBlocksPerLine = std::max<int>(1, 64 / (simd::kBlock * sizeof(T)));
  for (int64_t t = begin; t < end; ++t) {
    const T* x = static_cast<const T*>(p.x) + t * p.x_row_stride;
    const T* gate = static_cast<const T*>(p.gate) + t * p.gate_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    const bool ahead = t + 1 < end;
    simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
      if constexpr (std::is_same_v<decltype(n), simd::Block16>) {
        if (ahead && (i / simd::kBlock) % kBlocksPerLine == 0) {
          for (int s = 0; s < p.streams; ++s) {
            const int64_t at = static_cast<int64_t>(s) * H + i;
            __builtin_prefetch(x + p.x_row_stride + at, 0, 3);
            __builtin_prefetch(gate + p.gate_row_stride + at, 0, 3);
          }
        }
      }
      auto acc = zero_like(load_n(x + i, n));
      for (int s = 0; s < p.streams; ++s) {
        const int64_t at = static_cast<int64_t>(s) * H + i;
        if constexpr (sizeof(T) == 2) {
          acc += lookup(table, reinterpret_cast<const uint16_t*>(gate + at), n) * load_n(x + at, n);
        } else {
          acc += sigmoid(load_n(gate + at, n)) * load_n(x + at, n);
        }
      }
      simd::store_n(out + i, divide(acc, hc), n);
    });
  }
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE void silu_rows(const HcSiluParams& p, int64_t begin, int64_t end) {
  const float hc = static_cast<float>(p.hc_count);
  for (int64_t t = begin; t < end; ++t) {
    const T* x = static_cast<const T*>(p.x) + t * p.x_row_stride;
    T* y = static_cast<T*>(p.y) + t * p.y_row_stride;
    simd::for_each_block(0, p.width, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
      const auto z = divide(load_n(x + i, n), hc);
      simd::store_n(y + i, z * sigmoid(z), n);
    });
  }
}

#define QWEN4EXP_HC_MIX_ENTRY(NAME, PARAMS, BODY, T)                           \
  QWEN4EXP_CPU_CLONES void NAME(const PARAMS& p, int64_t begin, int64_t end) { \
    BODY<T>(p, begin, end);                                                    \
  }
QWEN4EXP_HC_MIX_ENTRY(gate_mix_f32, HcGateMixParams, gate_mix_rows, float)
QWEN4EXP_HC_MIX_ENTRY(gate_mix_bf16, HcGateMixParams, gate_mix_rows, bf16_t)
QWEN4EXP_HC_MIX_ENTRY(gate_mix_f16, HcGateMixParams, gate_mix_rows, f16_t)
QWEN4EXP_HC_MIX_ENTRY(silu_f32, HcSiluParams, silu_rows, float)
QWEN4EXP_HC_MIX_ENTRY(silu_bf16, HcSiluParams, silu_rows, bf16_t)
QWEN4EXP_HC_MIX_ENTRY(silu_f16, HcSiluParams, silu_rows, f16_t)
#undef QWEN4EXP_HC_MIX_ENTRY

// Rows per thread: a few rows of some thousand elements already fill one.
int64_t grain_for(int64_t elements_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elements_per_row));
}

}  // namespace

void run_hc_gate_mix_cpu(const HcGateMixParams& p) {
  if (p.num_tokens == 0) return;
  using Rows = void (*)(const HcGateMixParams&, int64_t, int64_t);
  const Rows rows = p.dtype == Dtype::kF32    ? gate_mix_f32
                    : p.dtype == Dtype::kBF16 ? gate_mix_bf16
                    : p.dtype == Dtype::kF16
                        ? gate_mix_f16
                        : throw std::invalid_argument("hc_gate_mix: no CPU kernel for this dtype");
  cpu::parallel_for(0, p.num_tokens, grain_for(int64_t{p.width} * p.streams),
                    [&](int64_t begin, int64_t end) { rows(p, begin, end); });
}

void run_hc_silu_cpu(const HcSiluParams& p) {
  if (p.num_tokens == 0) return;
  using Rows = void (*)(const HcSiluParams&, int64_t, int64_t);
  const Rows rows = p.dtype == Dtype::kF32    ? silu_f32
                    : p.dtype == Dtype::kBF16 ? silu_bf16
                    : p.dtype == Dtype::kF16
                        ? silu_f16
                        : throw std::invalid_argument("hc_silu: no CPU kernel for this dtype");
  cpu::parallel_for(0, p.num_tokens, grain_for(p.width),
                    [&](int64_t begin, int64_t end) { rows(p, begin, end); });
}

}  // namespace qwen4exp
