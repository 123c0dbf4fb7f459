// CPU kernel for ple_gate (SPEC §5).
//
// Parallel over tokens; one token's M streams are done in one visit, so key, hidden and value are
// read from memory once and every later pass over a stream runs out of L1.
//
// "vllm" rounding mirrors vLLM 0.33.0's `_ple_gate_kernel` operation by operation: the same fp32
// expressions in the same order, rounded to the storage dtype at the same points. Its reductions
// use numpy's pairwise order over the kernel's power-of-two block (8 lane accumulators per
// 128-element leaf, then a binary tree of leaves), which is the order Triton's interpreter sums
// in; so in fp16 this kernel equals vLLM's kernel run by the interpreter bit for bit, and the
// order is a well-conditioned, vectorisable one in its own right. Σk² and Σq² are summed side by
// side in one sweep (each in its own order), so that the two rows stream in together.
//
// Rows are walked in simd.h's blocks of 16, which hold 16-bit rows split into even and odd
// elements; the norm weights are laid out to match (weight_slot), and the pairwise sums keep
// numpy's lanes apart (add_in_numpy_lanes). The loops are bound by instruction count, and this
// halves the cost of each 16-bit load and store.
//
// "fp32" rounding is the fast single pass: per stream one sweep accumulates Σk², Σq² and
// Σk·q·(1+w_k)(1+w_q) (the two norm weights fused into one), the conv norm of gated = g·value
// reuses one Σvalue² per token for all M streams (Σ(g·v)² = g²·Σv²), and only the two outputs
// are rounded.

// Bit parity needs every product rounded before it is added, as vLLM's kernel (and PyTorch)
// compute; GCC would otherwise contract a*b+c into an FMA in the AVX2/AVX-512 clones. Set for
// the whole file, before any include, so that every inline function shares the option (GCC does
// not inline across differing optimisation options).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "../common/dispatch.h"
#include "../common/ple_gate.h"
#include "numpy_sum.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

using numpy_order::kPairwiseLeaf;
using numpy_order::numpy_sum;
using numpy_order::numpy_sums;
using simd::f32x8;
using simd::kLanes;

// The norm weights as fp32 (1 + w) factors, built once per call, each stream's row in the block
// layout of the activation dtype (simd::block_position) so that blocks of weights and of
// activations load alike.
struct GateWeights {
  std::vector<float> key1, query1, conv1;  // vllm rounding
  std::vector<float> fused;                // fp32 rounding: (1 + w_k)(1 + w_q)
  bool nan_free = true;                    // no factor is NaN (see gate_rows_vllm)
};

// Index in a weight row of channel c, for a stream width H, in the layout of activation type A.
template <typename A>
int64_t weight_slot(int64_t c, int H) {
  const int64_t j = c % H;
  return c - j + simd::block_slot<A>(j, H);
}

template <typename A, typename W>
void fill_weights(const PleGateParams& p, GateWeights& w) {
  const int64_t channels = static_cast<int64_t>(p.width) * p.streams;
  const W* wk = static_cast<const W*>(p.norm_key_w);
  const W* wq = static_cast<const W*>(p.norm_query_w);
  const W* wc = static_cast<const W*>(p.norm_conv_w);
  const bool vllm = p.rounding == GateRounding::kVllm;
  w.conv1.resize(channels);
  (vllm ? w.key1 : w.fused).resize(channels);
  if (vllm) w.query1.resize(channels);
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t slot = weight_slot<A>(c, p.width);
    const float k1 = 1.0f + to_float(wk[c]);
    const float q1 = 1.0f + to_float(wq[c]);
    w.conv1[slot] = 1.0f + to_float(wc[c]);
    w.nan_free = w.nan_free && !std::isnan(k1) && !std::isnan(q1) && !std::isnan(w.conv1[slot]);
    if (vllm) {
      w.key1[slot] = k1;
      w.query1[slot] = q1;
    } else {
      w.fused[slot] = k1 * q1;
    }
  }
}

// Token t's rows of the three inputs and the two outputs.
template <typename T>
struct TokenRows {
  const T* key;
  const T* hidden;
  const T* value;
  T* gated;
  T* conv_input;

  QWEN4EXP_ALWAYS_INLINE TokenRows(const PleGateParams& p, int64_t t)
      : key(static_cast<const T*>(p.key) + t * p.key_row_stride),
        hidden(static_cast<const T*>(p.hidden) + t * p.hidden_row_stride),
        value(static_cast<const T*>(p.value) + t * p.value_row_stride),
        gated(static_cast<T*>(p.gated) + t * p.gated_row_stride),
        conv_input(static_cast<T*>(p.conv_input) + t * p.conv_input_row_stride) {}
};

// Token t's input rows, prefetched into L2 while the token before it is computed. A token reads
// from 2·M + 1 places at once (every stream's key and hidden, and the value), more streams than
// the hardware prefetchers keep up with: on a 2-core Zen 5 VM the fp32 gate at prefill went from
// 53% to 58% of a same-footprint copy at 1 thread and from 55% to 68% at 2.
// (Always inlined: GCC deletes calls to a function that only prefetches; see row_prefetch.h.)
template <typename T>
QWEN4EXP_ALWAYS_INLINE void prefetch_token_rows(const PleGateParams& p, int64_t t) {
  const TokenRows<T> row(p, t);
  constexpr int64_t kLine = 64 / sizeof(T);
  const int64_t channels = static_cast<int64_t>(p.width) * p.streams;
  for (int64_t i = 0; i < channels; i += kLine) {
    __builtin_prefetch(row.key + i, 0, 2);
    __builtin_prefetch(row.hidden + i, 0, 2);
  }
  for (int64_t i = 0; i < p.width; i += kLine) __builtin_prefetch(row.value + i, 0, 2);
}

// kNaNs: what the roundings may assume (simd::NaNs); kLowHalfZero where the weight factors hold no
// NaN, since every other operand is bf16, a value rounded to it, or a NaN-free scalar.
template <typename T, simd::NaNs kNaNs = simd::NaNs::kAny>
QWEN4EXP_ALWAYS_INLINE void gate_rows_vllm(const PleGateParams& p, const GateWeights& w,
                                           int64_t begin, int64_t end) {
  using simd::load_n;
  using simd::splat;
  const int H = p.width;
  const float h_f = static_cast<float>(H);
  const float sqrt_h = std::sqrt(h_f);
  const float eps = p.eps;
  std::vector<float> leaf_buf(2 * (H / kPairwiseLeaf + 1));
  float* leaves = leaf_buf.data();
  for (int64_t t = begin; t < end; ++t) {
    const TokenRows<T> row(p, t);
    if (t + 1 < end) prefetch_token_rows<T>(p, t + 1);
    for (int m = 0; m < p.streams; ++m) {
      const int64_t base = static_cast<int64_t>(m) * H;
      const T* k = row.key + base;
      const T* q = row.hidden + base;
      const float* wk = w.key1.data() + base;
      const float* wq = w.query1.data() + base;
      const float* wc = w.conv1.data() + base;
      T* gated = row.gated + base;
      T* conv = row.conv_input + base;

      // clang-format off: a lambda argument before `leaves` would put every argument on a line
      const auto [sum_kk, sum_qq] = numpy_sums<T, 2>(H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        const auto x = load_n(k + i, n);
        const auto y = load_n(q + i, n);
        return std::array{x * x, y * y};
      }, leaves);
      const f32x8 rk = splat(1.0f / std::sqrt(sum_kk / h_f + eps));
      const f32x8 rq = splat(1.0f / std::sqrt(sum_qq / h_f + eps));
      const float dot = round_to<T>(numpy_sum<T>(H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        const auto kn = simd::round<T, kNaNs>(load_n(k + i, n) * rk * load_n(wk + i, n));
        const auto qn = simd::round<T, kNaNs>(load_n(q + i, n) * rq * load_n(wq + i, n));
        return simd::round<T, kNaNs>(kn * qn);
      }, leaves));
      const float d = round_to<T>(dot / sqrt_h);
      const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
      const float magnitude = round_to<T>(std::sqrt(gate_magnitude_floor(d)));
      const f32x8 g = splat(round_to<T>(sigmoid_f32(sign * magnitude)));

      // gated = round(g·value) is stored as it is summed; the conv norm reads it back.
      const float sum_gg = numpy_sum<T>(H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        const auto x = simd::round<T, kNaNs>(g * load_n(row.value + i, n));
        simd::store_n<kNaNs>(gated + i, x, n);
        return x * x;
      }, leaves);
      // clang-format on
      const f32x8 rg = splat(1.0f / std::sqrt(sum_gg / h_f + eps));
      simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        simd::store_n<kNaNs>(conv + i, load_n(gated + i, n) * rg * load_n(wc + i, n), n);
      });
    }
  }
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE void gate_rows_vllm_nan_free_weights(const PleGateParams& p,
                                                            const GateWeights& w, int64_t begin,
                                                            int64_t end) {
  gate_rows_vllm<T, simd::NaNs::kLowHalfZero>(p, w, begin, end);
}

// The fp32 pass's sums, in any order: per block into two accumulators, a tail step into one.
using simd::f32x16;
constexpr f32x16 zero16 = {};
QWEN4EXP_ALWAYS_INLINE void add_to(f32x16& acc, f32x16 t) { acc += t; }
QWEN4EXP_ALWAYS_INLINE void add_to(f32x16& acc, f32x8 t) { acc.lo += t; }
QWEN4EXP_ALWAYS_INLINE float lane_sum(f32x16 acc) {
  const f32x8 v = acc.lo + acc.hi;
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += v[j];
  return sum;
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE void gate_rows_fp32(const PleGateParams& p, const GateWeights& w,
                                           int64_t begin, int64_t end) {
  using simd::load_n;
  using simd::splat;
  const int H = p.width;
  const float h_f = static_cast<float>(H);
  const float sqrt_h = std::sqrt(h_f);
  const float eps = p.eps;
  for (int64_t t = begin; t < end; ++t) {
    const TokenRows<T> row(p, t);
    if (t + 1 < end) prefetch_token_rows<T>(p, t + 1);
    // One Σvalue² serves every stream: Σ(g·v)² = g²·Σv².
    f32x16 acc_vv = zero16;
    simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
      const auto v = load_n(row.value + i, n);
      add_to(acc_vv, v * v);
    });
    const float sum_vv = lane_sum(acc_vv);

    for (int m = 0; m < p.streams; ++m) {
      const int64_t base = static_cast<int64_t>(m) * H;
      const T* k = row.key + base;
      const T* q = row.hidden + base;
      const float* wf = w.fused.data() + base;
      const float* wc = w.conv1.data() + base;
      f32x16 acc_kk = zero16, acc_qq = zero16, acc_kq = zero16;
      simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        const auto kv = load_n(k + i, n);
        const auto qv = load_n(q + i, n);
        add_to(acc_kk, kv * kv);
        add_to(acc_qq, qv * qv);
        add_to(acc_kq, kv * qv * load_n(wf + i, n));
      });
      const float sum_kk = lane_sum(acc_kk);
      const float sum_qq = lane_sum(acc_qq);
      const float sum_kq = lane_sum(acc_kq);
      const float rk = 1.0f / std::sqrt(sum_kk / h_f + eps);
      const float rq = 1.0f / std::sqrt(sum_qq / h_f + eps);
      const float d = sum_kq * rk * rq / sqrt_h;
      const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
      const float g = sigmoid_f32(sign * std::sqrt(gate_magnitude_floor(d)));
      const float rg = 1.0f / std::sqrt(g * g * sum_vv / h_f + eps);
      const f32x8 g8 = splat(g);
      const f32x8 g_rg = splat(g * rg);
      T* gated = row.gated + base;
      T* conv = row.conv_input + base;
      simd::for_each_block(0, H, [&](int i, auto n) QWEN4EXP_LAMBDA_INLINE {
        const auto v = load_n(row.value + i, n);
        simd::store_n(gated + i, g8 * v, n);
        simd::store_n(conv + i, g_rg * v * load_n(wc + i, n), n);
      });
    }
  }
}

// One non-template entry per (dtype, rounding), each compiled for three instruction sets.
#define QWEN4EXP_GATE_ENTRY(NAME, T, BODY)                                                   \
  QWEN4EXP_CPU_CLONES void NAME(const PleGateParams& p, const GateWeights& w, int64_t begin, \
                                int64_t end) {                                               \
    BODY<T>(p, w, begin, end);                                                               \
  }
QWEN4EXP_GATE_ENTRY(gate_f32_vllm, float, gate_rows_vllm)
QWEN4EXP_GATE_ENTRY(gate_bf16_vllm, bf16_t, gate_rows_vllm)
QWEN4EXP_GATE_ENTRY(gate_bf16_vllm_nan_free_weights, bf16_t, gate_rows_vllm_nan_free_weights)
QWEN4EXP_GATE_ENTRY(gate_f16_vllm, f16_t, gate_rows_vllm)
QWEN4EXP_GATE_ENTRY(gate_f32_fp32, float, gate_rows_fp32)
QWEN4EXP_GATE_ENTRY(gate_bf16_fp32, bf16_t, gate_rows_fp32)
QWEN4EXP_GATE_ENTRY(gate_f16_fp32, f16_t, gate_rows_fp32)
#undef QWEN4EXP_GATE_ENTRY

constexpr const char* kNoActivationKernel = "ple_gate: no CPU kernel for this activation dtype";

using GateRowsFn = void (*)(const PleGateParams&, const GateWeights&, int64_t, int64_t);

GateRowsFn pick_gate_rows(Dtype dtype, GateRounding rounding, bool nan_free_weights) {
  const bool vllm = rounding == GateRounding::kVllm;
  switch (dtype) {
    case Dtype::kBF16:
      if (!vllm) return gate_bf16_fp32;
      return nan_free_weights ? gate_bf16_vllm_nan_free_weights : gate_bf16_vllm;
    case Dtype::kF16: return vllm ? gate_f16_vllm : gate_f16_fp32;
    case Dtype::kF32: return vllm ? gate_f32_vllm : gate_f32_fp32;
    default: throw std::invalid_argument(kNoActivationKernel);
  }
}

}  // namespace

void run_ple_gate_cpu(const PleGateParams& p) {
  if (p.num_tokens == 0) return;
  const int64_t channels = static_cast<int64_t>(p.width) * p.streams;
  GateWeights w;
  dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto activation) {
        dispatch_dtype(
            kFloatDtypes, p.weight_dtype,
            [&](auto weight) {
              fill_weights<typename decltype(activation)::type, typename decltype(weight)::type>(p,
                                                                                                 w);
            },
            [] { throw std::invalid_argument("ple_gate: no CPU kernel for this weight dtype"); });
      },
      [] { throw std::invalid_argument(kNoActivationKernel); });
  const GateRowsFn rows = pick_gate_rows(p.dtype, p.rounding, w.nan_free);
  // A token is C elements of three inputs and two outputs: a few tokens already fill a thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / channels);
  cpu::parallel_for(0, p.num_tokens, grain,
                    [&](int64_t begin, int64_t end) { rows(p, w, begin, end); });
}

}  // namespace qwen4exp
