// CPU kernels for the hyper-connection mixes (csrc/common/hc_mix.h, issue #50): hc_gate_mix and
// hc_silu. Element-wise, parallel over tokens, in simd.h's blocks; the sigmoid is 1 / (1 +
// exp(-z)), of a 16-bit gate looked up (exact: the GPU kernels' value), a 16-bit hc_silu's whole
// output looked up by its input's bits (exact too), else with simd.h's vectorised exp (~1 ulp: the
// results can differ from vLLM's kernels, and from the GPU's correctly rounded exp, by a unit in
// the last place of their dtype where the fp32 value lands next to a rounding boundary;
// testing.TOLERANCES states the tolerance). gate_mix sums the streams in fp32 from 0 in stream
// order, then divides by HC, as vLLM does.

// No a*b+c contracted into an FMA: vLLM's order of roundings (see ple_gate.cpp).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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

// fp32 (and a 16-bit dtype with a divisor past kSiluTableMaxHc): z = x / HC, z·sigmoid(z) with
// simd.h's exp.
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

// 16-bit dtypes: the output is a function of the input's 16 bits (and HC), so it is looked up
// (silu_table): three memory operations an element, where the vector SiLU is a division by HC,
// some 20 operations of exp and a second division (bf16 prefill, T = 8192 x 320, Zen 4 2-core
// KVM: 2.75 -> 1.20 ms at 1 thread, 1.40 -> 0.59 at 2; torch's eager F.silu(x / HC) took
// 2.1-6.5). The values are the same: the vector path measured exact on every 16-bit input.
// Not cloned: scalar loads gain nothing from wider vectors, and AVX-512 gathers of a table were
// the slower lookup in hc_gate_mix and ple_conv.
void silu_lookup(const HcSiluParams& p, const uint16_t* table, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const uint16_t* x = static_cast<const uint16_t*>(p.x) + t * p.x_row_stride;
    uint16_t* y = static_cast<uint16_t*>(p.y) + t * p.y_row_stride;
#pragma GCC unroll 8
    for (int i = 0; i < p.width; ++i) y[i] = table[x[i]];
  }
}

// The divisors whose tables are kept (128 KiB each, made on first use, ~2 ms): the released
// model's HC is 4; a larger divisor takes the vector SiLU, so no argument can grow this cache
// without bound.
constexpr int kSiluTableMaxHc = 64;

// y for every 16-bit pattern x of T: z = x / HC in fp32, z·sigmoid_f32(z) (the GPU kernels'
// formula and correctly rounded exp, csrc/hip/hc_mix.hip) rounded to T, so the CPU's 16-bit
// hc_silu equals the GPU's bit for bit; null for a divisor past kSiluTableMaxHc.
template <typename T>
const uint16_t* silu_table(int hc) {
  if (hc < 1 || hc > kSiluTableMaxHc) return nullptr;
  // Published once, lock-free (a mutex held across a fork would hang the child): threads that
  // race each build a table, one is kept, the others' are freed. Kept for the process's life.
  static std::atomic<const uint16_t*> tables[kSiluTableMaxHc + 1];
  const uint16_t* found = tables[hc].load(std::memory_order_acquire);
  if (found != nullptr) return found;
  auto made = std::make_unique<uint16_t[]>(65536);
  const float divisor = static_cast<float>(hc);
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float z = to_float(T{static_cast<uint16_t>(bits)}) / divisor;
    made[bits] = from_float<T>(z * sigmoid_f32(z)).bits;
  }
  if (tables[hc].compare_exchange_strong(found, made.get(), std::memory_order_acq_rel)) {
    return made.release();
  }
  return found;  // another thread's, published first
}

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
  const uint16_t* table = p.dtype == Dtype::kBF16  ? silu_table<bf16_t>(p.hc_count)
                          : p.dtype == Dtype::kF16 ? silu_table<f16_t>(p.hc_count)
                                                   : nullptr;
  if (table != nullptr) {
    cpu::parallel_for(0, p.num_tokens, grain_for(p.width),
                      [&](int64_t begin, int64_t end) { silu_lookup(p, table, begin, end); });
    return;
  }
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
