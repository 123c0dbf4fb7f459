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
// order is a well-conditioned, vectorisable one in its own right.
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
#include <cmath>
#include <stdexcept>
#include <vector>

#include "../common/dispatch.h"
#include "../common/ple_gate.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

using simd::f32x8;
using simd::kLanes;
constexpr int kPairwiseLeaf = 128;  // numpy's PW_BLOCKSIZE

// ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)): how numpy folds its eight lane accumulators.
QWEN4EXP_ALWAYS_INLINE float fold_lanes(f32x8 r) {
  return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
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

// Σ terms(i) over i < n in numpy's pairwise order over the zero-padded power-of-two block (see
// the file comment). terms(i, lanes) returns the 8 terms at [i, i+8), the lanes past `lanes`
// zero. n >= 5 (smaller H sums sequentially, see sequential_sum).
template <typename Terms>
QWEN4EXP_ALWAYS_INLINE float pairwise_sum(int n, const Terms& terms, float* leaves) {
  const int num_leaves = (n + kPairwiseLeaf - 1) / kPairwiseLeaf;
  for (int b = 0; b < num_leaves; ++b) {
    const int end = std::min(n, (b + 1) * kPairwiseLeaf);
    f32x8 r = simd::splat(0.0f);
    for (int i = b * kPairwiseLeaf; i < end; i += kLanes) r += terms(i, std::min(kLanes, end - i));
    leaves[b] = fold_lanes(r);
  }
  return fold_leaves(leaves, num_leaves);
}

// numpy's order for blocks shorter than 8 (H <= 4): one running sum from 0.
template <typename Terms>
QWEN4EXP_ALWAYS_INLINE float sequential_sum(int n, const Terms& terms) {
  const f32x8 t = terms(0, n);
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += t[i];
  return sum;
}

template <typename Terms>
QWEN4EXP_ALWAYS_INLINE float numpy_sum(int n, const Terms& terms, float* leaves) {
  return n <= 4 ? sequential_sum(n, terms) : pairwise_sum(n, terms, leaves);
}

// The norm weights as fp32 (1 + w) factors, built once per call.
struct GateWeights {
  std::vector<float> key1, query1, conv1;  // vllm rounding
  std::vector<float> fused;                // fp32 rounding: (1 + w_k)(1 + w_q)
};

template <typename W>
void fill_weights(const PleGateParams& p, int64_t channels, GateWeights& w) {
  const W* wk = static_cast<const W*>(p.norm_key_w);
  const W* wq = static_cast<const W*>(p.norm_query_w);
  const W* wc = static_cast<const W*>(p.norm_conv_w);
  w.conv1.resize(channels);
  for (int64_t c = 0; c < channels; ++c) w.conv1[c] = 1.0f + to_float(wc[c]);
  if (p.rounding == GateRounding::kVllm) {
    w.key1.resize(channels);
    w.query1.resize(channels);
    for (int64_t c = 0; c < channels; ++c) {
      w.key1[c] = 1.0f + to_float(wk[c]);
      w.query1[c] = 1.0f + to_float(wq[c]);
    }
  } else {
    w.fused.resize(channels);
    for (int64_t c = 0; c < channels; ++c) {
      w.fused[c] = (1.0f + to_float(wk[c])) * (1.0f + to_float(wq[c]));
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

template <typename T>
QWEN4EXP_ALWAYS_INLINE void gate_rows_vllm(const PleGateParams& p, const GateWeights& w,
                                           int64_t begin, int64_t end) {
  using simd::load_n;
  using simd::splat;
  const int H = p.width;
  const float h_f = static_cast<float>(H);
  const float sqrt_h = std::sqrt(h_f);
  const float eps = p.eps;
  std::vector<float> leaf_buf(H / kPairwiseLeaf + 1);
  float* leaves = leaf_buf.data();
  for (int64_t t = begin; t < end; ++t) {
    const TokenRows<T> row(p, t);
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
      const float sum_kk = numpy_sum(H, [&](int i, int n) QWEN4EXP_LAMBDA_INLINE {
        const f32x8 x = load_n(k + i, n);
        return x * x;
      }, leaves);
      const float sum_qq = numpy_sum(H, [&](int i, int n) QWEN4EXP_LAMBDA_INLINE {
        const f32x8 x = load_n(q + i, n);
        return x * x;
      }, leaves);
      const f32x8 rk = splat(1.0f / std::sqrt(sum_kk / h_f + eps));
      const f32x8 rq = splat(1.0f / std::sqrt(sum_qq / h_f + eps));
      const float dot = round_to<T>(numpy_sum(H, [&](int i, int n) QWEN4EXP_LAMBDA_INLINE {
        const f32x8 kn = simd::round<T>(load_n(k + i, n) * rk * load_n(wk + i, n));
        const f32x8 qn = simd::round<T>(load_n(q + i, n) * rq * load_n(wq + i, n));
        return simd::round<T>(kn * qn);
      }, leaves));
      const float d = round_to<T>(dot / sqrt_h);
      const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
      const float magnitude = round_to<T>(std::sqrt(std::max(std::fabs(d), 1e-6f)));
      const f32x8 g = splat(round_to<T>(sigmoid_f32(sign * magnitude)));

      // gated = round(g·value) is stored as it is summed; the conv norm reads it back.
      const float sum_gg = numpy_sum(H, [&](int i, int n) QWEN4EXP_LAMBDA_INLINE {
        const f32x8 x = simd::round<T>(g * load_n(row.value + i, n));
        simd::store_n(gated + i, x, n);
        return x * x;
      }, leaves);
      // clang-format on
      const f32x8 rg = splat(1.0f / std::sqrt(sum_gg / h_f + eps));
      for (int i = 0; i < H; i += kLanes) {
        const int n = std::min(kLanes, H - i);
        simd::store_n(conv + i, load_n(gated + i, n) * rg * load_n(wc + i, n), n);
      }
    }
  }
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
    // One Σvalue² serves every stream: Σ(g·v)² = g²·Σv².
    f32x8 acc_vv = splat(0.0f);
    for (int i = 0; i < H; i += kLanes) {
      const f32x8 v = load_n(row.value + i, std::min(kLanes, H - i));
      acc_vv += v * v;
    }
    float sum_vv = 0.f;
    for (int j = 0; j < kLanes; ++j) sum_vv += acc_vv[j];

    for (int m = 0; m < p.streams; ++m) {
      const int64_t base = static_cast<int64_t>(m) * H;
      const T* k = row.key + base;
      const T* q = row.hidden + base;
      const float* wf = w.fused.data() + base;
      const float* wc = w.conv1.data() + base;
      f32x8 acc_kk = splat(0.0f), acc_qq = splat(0.0f), acc_kq = splat(0.0f);
      for (int i = 0; i < H; i += kLanes) {
        const int n = std::min(kLanes, H - i);
        const f32x8 kv = load_n(k + i, n);
        const f32x8 qv = load_n(q + i, n);
        acc_kk += kv * kv;
        acc_qq += qv * qv;
        acc_kq += kv * qv * load_n(wf + i, n);
      }
      float sum_kk = 0.f, sum_qq = 0.f, sum_kq = 0.f;
      for (int j = 0; j < kLanes; ++j) {
        sum_kk += acc_kk[j];
        sum_qq += acc_qq[j];
        sum_kq += acc_kq[j];
      }
      const float rk = 1.0f / std::sqrt(sum_kk / h_f + eps);
      const float rq = 1.0f / std::sqrt(sum_qq / h_f + eps);
      const float d = sum_kq * rk * rq / sqrt_h;
      const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
      const float g = sigmoid_f32(sign * std::sqrt(std::max(std::fabs(d), 1e-6f)));
      const float rg = 1.0f / std::sqrt(g * g * sum_vv / h_f + eps);
      const f32x8 g8 = splat(g);
      const f32x8 g_rg = splat(g * rg);
      T* gated = row.gated + base;
      T* conv = row.conv_input + base;
      for (int i = 0; i < H; i += kLanes) {
        const int n = std::min(kLanes, H - i);
        const f32x8 v = load_n(row.value + i, n);
        simd::store_n(gated + i, g8 * v, n);
        simd::store_n(conv + i, g_rg * v * load_n(wc + i, n), n);
      }
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
QWEN4EXP_GATE_ENTRY(gate_f16_vllm, f16_t, gate_rows_vllm)
QWEN4EXP_GATE_ENTRY(gate_f32_fp32, float, gate_rows_fp32)
QWEN4EXP_GATE_ENTRY(gate_bf16_fp32, bf16_t, gate_rows_fp32)
QWEN4EXP_GATE_ENTRY(gate_f16_fp32, f16_t, gate_rows_fp32)
#undef QWEN4EXP_GATE_ENTRY

using GateRowsFn = void (*)(const PleGateParams&, const GateWeights&, int64_t, int64_t);

GateRowsFn pick_gate_rows(Dtype dtype, GateRounding rounding) {
  const bool vllm = rounding == GateRounding::kVllm;
  switch (dtype) {
    case Dtype::kBF16: return vllm ? gate_bf16_vllm : gate_bf16_fp32;
    case Dtype::kF16: return vllm ? gate_f16_vllm : gate_f16_fp32;
    case Dtype::kF32: return vllm ? gate_f32_vllm : gate_f32_fp32;
    default: throw std::invalid_argument("ple_gate: no CPU kernel for this activation dtype");
  }
}

}  // namespace

void run_ple_gate_cpu(const PleGateParams& p) {
  if (p.num_tokens == 0) return;
  const int64_t channels = static_cast<int64_t>(p.width) * p.streams;
  GateWeights w;
  dispatch_dtype(
      kFloatDtypes, p.weight_dtype,
      [&](auto dtype) { fill_weights<typename decltype(dtype)::type>(p, channels, w); },
      [] { throw std::invalid_argument("ple_gate: no CPU kernel for this weight dtype"); });
  const GateRowsFn rows = pick_gate_rows(p.dtype, p.rounding);
  // A token is C elements of three inputs and two outputs: a few tokens already fill a thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / channels);
  cpu::parallel_for(0, p.num_tokens, grain,
                    [&](int64_t begin, int64_t end) { rows(p, w, begin, end); });
}

}  // namespace qwen4exp
