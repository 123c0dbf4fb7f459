// CPU kernel for ple_conv (SPEC §6).
//
// One pass over the tokens computes every output from the *old* state (parallel over tokens;
// per token the K taps are row pointers — an input row, a state column or a zero row — and the
// channel loop runs over chunks of 512 channels in simd.h's blocks of 16, the weight rows laid
// out like the blocks); prefill and spec then write the new state back per request. Decode fuses
// the state shift into the token's own pass: a token is a request, so no other token reads its
// slot.
//
// Arithmetic follows vLLM 0.33.0's `_ple_conv_kernel` step by step: fp32 taps accumulated in
// order k = 0..K-1 from +0 (products rounded before the add), the sum rounded to the storage
// dtype, SiLU as x·(1/(1+exp(-x))) in fp32, then the fused residuals with their two roundings.
// For bf16/fp16 the SiLU of the rounded sum is a function of 16 bits: a 65536-entry table, built
// once with a correctly rounded exp, replaces the exp in the hot loop; fp32 uses a vectorised
// polynomial exp.
//
// Every index the data supplies is validated before any write (slots, token map, query starts),
// so a bad batch raises and leaves residual and conv_state untouched.

// Products must be rounded before they are added, as vLLM and PyTorch compute; GCC would
// otherwise contract a*b+c into an FMA in the AVX2/AVX-512 clones. Set before any include so
// that every inline function shares the option (GCC does not inline across differing options).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../common/ple_conv.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

constexpr int kChunk = 512;

// Every bf16 rounding here may drop its NaN select (simd::NaNs): its operands are bf16 values
// (inputs, state, residuals, SiLU table entries) and the fp32 weights, whose NaNs
// transpose_weights stores with a zero low half, so no NaN the sums make has payload bits there.
// The selects were a fifth of the channel loop's instructions.
constexpr simd::NaNs kNaNs = simd::NaNs::kLowHalfZero;

// ---- SiLU -------------------------------------------------------------------------------------

// round_T(SiLU(x)), back in fp32, for every 16-bit pattern x of T: vLLM's fp32 formula with a
// correctly rounded exp, computed once. The hot loop of a 16-bit conv looks its SiLU up here.
template <typename T>
const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const float x = to_float(T{static_cast<uint16_t>(bits)});
      t[bits] = round_to<T>(x * sigmoid_f32(x));
    }
    return t;
  }();
  return table.data();
}

using simd::exp_poly;

QWEN4EXP_ALWAYS_INLINE simd::f32x8 silu(simd::f32x8 x) {
  return x * (1.0f / (1.0f + exp_poly(-x)));
}

// y[i] = table[bits[i]] for i < n: the SiLU table's lookup sweep, a third of a bf16 prefill.
// Either a plain loop or, with AVX-512, a gather of 16 per instruction. Which is faster depends
// on the core's gather (on a Zen 4 VM the loop: 81 against 93 ms a prefill; on Zen 5 the two
// were even; an AVX2 gather was no faster on Zen 3), so by default the first call times both
// (timed_lookup). The clones of simd.h cannot name a gather intrinsic that the baseline clone
// lacks, so the choice is a function pointer.
using LookupFn = void (*)(const float* table, const uint32_t* bits, float* y, int n);

// Unrolled: the loop's own counter, compare and branch were two of its five instructions per
// element.
void lookup_scalar(const float* table, const uint32_t* bits, float* y, int n) {
#pragma GCC unroll 8
  for (int i = 0; i < n; ++i) y[i] = table[bits[i]];
}

#if QWEN4EXP_X86_AVX512
__attribute__((target("avx512f"))) void lookup_avx512(const float* table, const uint32_t* bits,
                                                      float* y, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i index = _mm512_loadu_si512(bits + i);
    // (the masked form: GCC 12's unmasked one warns of an uninitialised source operand)
    _mm512_storeu_ps(y + i, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xFFFF, index, table, 4));
  }
  for (; i < n; ++i) y[i] = table[bits[i]];
}
bool has_gather_lookup() { return simd::cpu_has_avx512f(); }
LookupFn gather_lookup() { return lookup_avx512; }
#else
bool has_gather_lookup() { return false; }
LookupFn gather_lookup() { return lookup_scalar; }  // (never chosen: has_gather_lookup)
#endif

// The faster lookup on this CPU: each one's best of several alternating sweeps over indices like
// a conv's (the bf16 bits of sums of small random values: a few thousand distinct entries, as
// activations give), tens of microseconds once per process. Both give the same values, so a
// noisy timing can only cost speed.
LookupFn timed_lookup(const float* table) {
  if (!has_gather_lookup()) return lookup_scalar;
  constexpr int kIndices = 4096;
  std::vector<uint32_t> bits(kIndices);
  std::vector<float> y(kIndices);
  uint32_t state = 12345;
  for (uint32_t& b : bits) {
    float x = -2.0f;
    for (int i = 0; i < 4; ++i) {
      state = state * 1664525u + 1013904223u;
      x += static_cast<float>(state >> 8) * (1.0f / 16777216.0f);
    }
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    b = u >> 16;
  }
  const LookupFn candidates[] = {lookup_scalar, gather_lookup()};
  double best[] = {1e30, 1e30};
  for (int round = 0; round < 8; ++round) {
    for (int c = 0; c < 2; ++c) {
      const auto start = std::chrono::steady_clock::now();
      candidates[c](table, bits.data(), y.data(), kIndices);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      best[c] = std::min(best[c], took.count());
    }
  }
  return best[1] < best[0] ? candidates[1] : candidates[0];
}

std::atomic<int64_t> silu_lookup_setting{kConvSiluTimed};

LookupFn current_lookup() {
  switch (silu_lookup_setting.load(std::memory_order_relaxed)) {
    case kConvSiluLoop: return lookup_scalar;
    case kConvSiluGather: return gather_lookup();
    default: {
      // Timed once, on the bf16 table: the fp16 one has the same size and use.
      static const LookupFn timed = timed_lookup(silu_table<bf16_t>());
      return timed;
    }
  }
}

// ---- per-call state ---------------------------------------------------------------------------

// One tap of one token: a row of C values with a channel stride (an input row, a state column,
// or the shared zero row).
template <typename T>
struct Tap {
  const T* ptr;
  int64_t stride;
};

template <typename T>
struct ConvCtx {
  const PleConvParams& p;
  const float* weights;  // [K][C] fp32 (transposed: one contiguous row per tap)
  const T* zeros;        // [C] zeros: the tap of a position with no history
  const float* silu;     // 16-bit types: silu_table<T>()
  LookupFn lookup;       // 16-bit types: looks SiLU up in silu

  T* state_entry(int64_t slot, int64_t w) const {
    return static_cast<T*>(p.conv_state) + slot * p.state_slot_stride + w * p.state_window_stride;
  }
  const T* input_row(int64_t physical) const {
    return static_cast<const T*>(p.inputs) + physical * p.inputs_row_stride;
  }
  T* residual_row(int64_t physical) const {
    return static_cast<T*>(p.residual) + physical * p.residual_row_stride;
  }
  const T* outer_row(int64_t physical) const {
    return p.outer_residual == nullptr
               ? nullptr
               : static_cast<const T*>(p.outer_residual) + physical * p.outer_row_stride;
  }
};

// Calls body(std::integral_constant<int, kK>) with kK = K for the released model's K = 4 (its
// taps unrolled, their pointers in registers: the runtime tap loop cost about a tenth of a
// prefill), else kK = 0 (the kernel size read at run time).
template <typename Body>
QWEN4EXP_ALWAYS_INLINE void with_kernel_size(int K, Body body) {
  if (K == 4) {
    body(std::integral_constant<int, 4>{});
  } else {
    body(std::integral_constant<int, 0>{});
  }
}

// ---- the channel loop of one token ------------------------------------------------------------

// The conv sum for one step of channels of one token (simd::for_each_block's step at chunk
// offset i, channel c = c0 + i): the K taps summed in order from +0. rows[k] is tap k's
// contiguous row from channel c0 (the chunk's first; see chunk_rows). A whole block comes back
// as an f32x16 in simd.h's block layout, which the weight rows share (see transpose_weights).
// kK: the kernel size when known at compile time (0: p's).
template <int kK, typename T, typename Step>
QWEN4EXP_ALWAYS_INLINE auto conv_sum(const ConvCtx<T>& ctx, const T* const* rows, int64_t c,
                                     int64_t i, Step step) {
  const int64_t channels = ctx.p.channels;
  decltype(simd::load_n(ctx.weights, step)) acc{};
  const int K = kK > 0 ? kK : ctx.p.kernel_size;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    acc += simd::load_n(ctx.weights + k * channels + c, step) * simd::load_n(rows[k] + i, step);
  }
  return acc;
}

// residual at channel c <- y for one step, through the fused residuals when there is an outer
// residual.
template <typename T, typename Y, typename Step>
QWEN4EXP_ALWAYS_INLINE void finish_step(T* residual, const T* outer, Y y, int64_t c, Step step) {
  T* res = residual + c;
  if (outer != nullptr) {
    const auto r = simd::load_n(res, step);
    const auto o = simd::load_n(outer + c, step);
    y = o + simd::round<T, kNaNs>(r + y);
  }
  simd::store_n<kNaNs>(res, y, step);
}

// residual[c0, c0+n) of one token from its K tap rows (see chunk_rows). `produce` false writes
// y = 0 (vLLM's inactive rows), still through the fused residuals; rows is then not read.
//
// The sum is rounded to the storage dtype before SiLU (F.conv1d materialises it). For 16-bit T
// the chunk goes in three sweeps: the sums' storage bits into a buffer, the SiLU table looked up
// from it (ctx.lookup), then the residuals; looking up in the vector loop pulled each index
// out of its register one instruction at a time. fp32 computes SiLU in the loop, a block's two
// halves keeping two independent exp/divide chains in flight.
template <int kK, typename T>
QWEN4EXP_ALWAYS_INLINE void conv_chunk(const ConvCtx<T>& ctx, const T* const* rows, int64_t c0,
                                       int n, bool produce, T* residual, const T* outer) {
  if constexpr (std::is_same_v<T, float>) {
    simd::for_each_block(0, n, [&](int i, auto step) QWEN4EXP_LAMBDA_INLINE {
      const int64_t c = c0 + i;
      using Y = decltype(conv_sum<kK>(ctx, rows, c, i, step));
      Y y{};
      if (produce) {
        const Y acc = conv_sum<kK>(ctx, rows, c, i, step);
        if constexpr (std::is_same_v<Y, simd::f32x16>) {
          y = simd::f32x16{silu(acc.lo), silu(acc.hi)};
        } else {
          y = silu(acc);
        }
      }
      finish_step(residual, outer, y, c, step);
    });
  } else {
    // Both in the block layout; a partial step writes whole 8-lane groups (n <= kChunk).
    alignas(64) uint32_t bits[kChunk];
    alignas(64) float y[kChunk];
    if (produce) {
      simd::for_each_block(0, n, [&](int i, auto step) QWEN4EXP_LAMBDA_INLINE {
        const auto acc = conv_sum<kK>(ctx, rows, c0 + i, i, step);
        if constexpr (std::is_same_v<decltype(acc), const simd::f32x16>) {
          const simd::u32x8 lo = simd::bits_u32<T, kNaNs>(acc.lo);
          const simd::u32x8 hi = simd::bits_u32<T, kNaNs>(acc.hi);
          std::memcpy(bits + i, &lo, sizeof(lo));
          std::memcpy(bits + i + simd::kLanes, &hi, sizeof(hi));
        } else {
          const simd::u32x8 b = simd::bits_u32<T, kNaNs>(acc);
          std::memcpy(bits + i, &b, sizeof(b));
        }
      });
      ctx.lookup(ctx.silu, bits, y, n);
    }
    simd::for_each_block(0, n, [&](int i, auto step) QWEN4EXP_LAMBDA_INLINE {
      using Y = decltype(simd::load_n(y, step));
      finish_step(residual, outer, produce ? simd::load_n(y + i, step) : Y{}, c0 + i, step);
    });
  }
}

// Tap k's row of the chunk [c0, c0+n) in rows[k]: a tap of channel stride 1 is read in place, a
// strided one (a state column of a dim-first or otherwise strided state) is copied into a
// column buffer first. A strided load lane by lane inside the vector loop made a dim-first
// decode several times slower; one contiguous form also keeps one copy of the channel loop per
// kernel size, dtype and instruction set. A token's last tap is never a state column (its
// history position j + (K-1)·δ >= S), so K - 1 buffers suffice.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void chunk_rows(const Tap<T>* taps, int K, int64_t c0, int n,
                                       T (&columns)[kMaxConvKernel - 1][kChunk], const T** rows) {
  int copied = 0;
  for (int k = 0; k < K; ++k) {
    const int64_t stride = taps[k].stride;
    const T* first = taps[k].ptr + c0 * stride;
    if (stride == 1) {
      rows[k] = first;
      continue;
    }
    T* column = columns[copied++];
    for (int i = 0; i < n; ++i) column[i] = first[i * stride];
    rows[k] = column;
  }
}

// dst[c] = src[c] (or 0) for c in [c0, c0+n): one state entry, channel-strided.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void copy_entry(T* dst, int64_t dst_stride, const T* src, int64_t src_stride,
                                       int64_t c0, int n) {
  if (src == nullptr) {
    for (int i = 0; i < n; ++i) dst[(c0 + i) * dst_stride] = from_float<T>(0.0f);
  } else if (dst_stride == 1 && src_stride == 1) {
    std::memmove(dst + c0, src + c0, sizeof(T) * n);
  } else {
    for (int i = 0; i < n; ++i) dst[(c0 + i) * dst_stride] = src[(c0 + i) * src_stride];
  }
}

// ---- decode -----------------------------------------------------------------------------------

// A dim-first state (vLLM's VLLM_SSM_CONV_STATE_LAYOUT=DS: [slots, C, W], window stride 1)
// keeps each channel's window together, so a tap is a column C·W elements long: chunk_rows
// copies the chunk's K-1 tap columns into rows first, and when the window is the whole channel
// row (W = S) the state shifts with one memmove of the chunk's n·S - 1 elements plus a store of
// x per channel.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void decode_tokens(const ConvCtx<T>& ctx, int64_t begin, int64_t end) {
  const PleConvParams& p = ctx.p;
  const int K = p.kernel_size;
  const int S = p.state_len;
  const int64_t cs = p.state_channel_stride;
  const bool dim_first = cs != 1 && p.state_window_stride == 1;
  const bool shift_by_memmove = dim_first && cs == S && S > 0;
  Tap<T> taps[kMaxConvKernel];
  alignas(64) T columns[kMaxConvKernel - 1][kChunk];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row = conv_physical_row(p, t);
    const int64_t slot = p.state_indices[t];
    const bool live = slot != kNullSlot;
    const bool init = !p.has_initial_states.present() || p.has_initial_states[t] != 0;
    const bool read = live && init;
    const T* x = ctx.input_row(row);
    for (int k = 0; k + 1 < K; ++k) {
      taps[k] = read ? Tap<T>{ctx.state_entry(slot, int64_t{k} * p.dilation), cs}
                     : Tap<T>{ctx.zeros, 1};
    }
    taps[K - 1] = Tap<T>{x, 1};
    T* residual = ctx.residual_row(row);
    const T* outer = ctx.outer_row(row);
    for (int64_t c0 = 0; c0 < p.channels; c0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, p.channels - c0));
      const T* rows[kMaxConvKernel];
      if (live) chunk_rows(taps, K, c0, n, columns, rows);
      with_kernel_size(K, [&](auto k) QWEN4EXP_LAMBDA_INLINE {
        conv_chunk<decltype(k)::value>(ctx, rows, c0, n, live, residual, outer);
      });
      if (!live) continue;
      // Shift the window by one and append x (zeros ++ x without an initial state).
      if (read && shift_by_memmove) {
        T* window = ctx.state_entry(slot, 0) + c0 * cs;
        std::memmove(window, window + 1, sizeof(T) * (static_cast<size_t>(n) * S - 1));
        for (int i = 0; i < n; ++i) window[i * cs + S - 1] = x[c0 + i];
        continue;
      }
      for (int i = 0; i + 1 < S; ++i) {
        copy_entry(ctx.state_entry(slot, i), cs, read ? ctx.state_entry(slot, i + 1) : nullptr, cs,
                   c0, n);
      }
      if (S > 0) copy_entry(ctx.state_entry(slot, S - 1), cs, x, 1, c0, n);
    }
  }
}

// ---- prefill / spec ---------------------------------------------------------------------------

// Lines [c0, c0+n) of a row, prefetched into L2 (locality 2: prefetcht1) one token ahead of the
// channel loop. A token reads C channels of its input, residual and outer rows for the first
// time from DRAM; with many streams and the loop's compute between their loads, the hardware
// prefetchers left a quarter of a bf16 prefill stalled on those first loads (Zen 4, 1 thread:
// 93 against 101 ms with the gather lookup, 81 against 95 with the plain loop).
// (Always inlined: GCC deletes calls to a function that only prefetches; see row_prefetch.h.)
template <typename T>
QWEN4EXP_ALWAYS_INLINE void prefetch_row_chunk(const T* row, int64_t c0, int n) {
  if (row == nullptr) return;
  const char* first = reinterpret_cast<const char*>(row + c0);
  const char* end = reinterpret_cast<const char*>(row + c0 + n);
  for (const char* line = first; line < end; line += 64) __builtin_prefetch(line, 0, 2);
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE void chunk_tokens(const ConvCtx<T>& ctx, int64_t begin, int64_t end) {
  const PleConvParams& p = ctx.p;
  const int K = p.kernel_size;
  const int S = p.state_len;
  const int64_t cs = p.state_channel_stride;
  const int64_t R = p.num_requests;
  const IndexView& qsl = p.query_start_loc;
  const bool spec = p.mode == ConvMode::kSpec;
  Tap<T> taps[kMaxConvKernel];
  alignas(64) T columns[kMaxConvKernel - 1][kChunk];
  int64_t r = R > 0 ? find_request(qsl, R, begin) : -1;
  for (int64_t t = begin; t < end; ++t) {
    while (r >= 0 && r + 1 < R && qsl[r + 1] <= t) ++r;
    const int64_t row = conv_physical_row(p, t);
    bool produce = false;
    if (r >= 0) {
      const int64_t start = qsl[r];
      const bool in_range = t >= start && t < qsl[R];
      const int64_t slot = p.state_indices[r];
      const bool live = slot != kNullSlot;
      const bool read = spec ? live : (live && p.has_initial_states[r] != 0);
      produce = in_range && (spec || live);
      if (produce) {
        const int64_t j = t - start;
        const int64_t offset = spec ? conv_spec_offset(p, r) : 0;
        for (int k = 0; k < K; ++k) {
          const int64_t h = j + int64_t{k} * p.dilation;
          if (h < S) {
            taps[k] = read ? Tap<T>{ctx.state_entry(slot, offset + h), cs} : Tap<T>{ctx.zeros, 1};
          } else {
            taps[k] = Tap<T>{ctx.input_row(conv_physical_row(p, start + h - S)), 1};
          }
        }
      }
    }
    T* residual = ctx.residual_row(row);
    const T* outer = ctx.outer_row(row);
    const int64_t next = t + 1 < end ? conv_physical_row(p, t + 1) : -1;
    const bool prefetch = next >= 0;
    for (int64_t c0 = 0; c0 < p.channels; c0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, p.channels - c0));
      if (prefetch) {
        prefetch_row_chunk(ctx.input_row(next), c0, n);
        prefetch_row_chunk(ctx.residual_row(next), c0, n);
        prefetch_row_chunk(ctx.outer_row(next), c0, n);
      }
      const T* rows[kMaxConvKernel];
      if (produce) chunk_rows(taps, K, c0, n, columns, rows);
      with_kernel_size(K, [&](auto k) QWEN4EXP_LAMBDA_INLINE {
        conv_chunk<decltype(k)::value>(ctx, rows, c0, n, produce, residual, outer);
      });
    }
  }
}

// The new window of request r, written in place in ascending entry order: entry i is read from
// an entry > i (or from the chunk), so every read sees the old state.
template <typename T>
QWEN4EXP_ALWAYS_INLINE void write_back_request(const ConvCtx<T>& ctx, int64_t r) {
  const PleConvParams& p = ctx.p;
  const int64_t slot = p.state_indices[r];
  if (slot == kNullSlot) return;
  const int S = p.state_len;
  const int64_t cs = p.state_channel_stride;
  const int64_t start = p.query_start_loc[r];
  const int64_t qlen = p.query_start_loc[r + 1] - start;
  int64_t shift, offset, count;
  bool init = true;
  if (p.mode == ConvMode::kSpec) {
    // Entries [0, S-1+qlen) become old[o+1 : o+S] ++ chunk; the unused tail is kept.
    shift = 1;
    offset = conv_spec_offset(p, r);
    count = std::min<int64_t>(S - 1 + qlen, S + p.query_len - 1);
  } else {
    if (qlen <= 0) return;  // an empty request keeps its state
    shift = qlen;
    offset = 0;
    count = S;
    init = p.has_initial_states[r] != 0;
  }
  for (int64_t c0 = 0; c0 < p.channels; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, p.channels - c0));
    for (int64_t i = 0; i < count; ++i) {
      const int64_t m = shift + i;
      T* dst = ctx.state_entry(slot, i);
      if (m < S) {
        copy_entry(dst, cs, init ? ctx.state_entry(slot, offset + m) : nullptr, cs, c0, n);
      } else {
        copy_entry(dst, cs, ctx.input_row(conv_physical_row(p, start + m - S)), 1, c0, n);
      }
    }
  }
}

// ---- entry points per dtype (each compiled for three instruction sets) ------------------------

#define QWEN4EXP_CONV_ENTRY(NAME, T, BODY)                                           \
  QWEN4EXP_CPU_CLONES void NAME(const ConvCtx<T>& ctx, int64_t begin, int64_t end) { \
    BODY<T>(ctx, begin, end);                                                        \
  }
QWEN4EXP_CONV_ENTRY(decode_f32, float, decode_tokens)
QWEN4EXP_CONV_ENTRY(decode_bf16, bf16_t, decode_tokens)
QWEN4EXP_CONV_ENTRY(decode_f16, f16_t, decode_tokens)
QWEN4EXP_CONV_ENTRY(chunk_f32, float, chunk_tokens)
QWEN4EXP_CONV_ENTRY(chunk_bf16, bf16_t, chunk_tokens)
QWEN4EXP_CONV_ENTRY(chunk_f16, f16_t, chunk_tokens)
#undef QWEN4EXP_CONV_ENTRY

template <typename T>
struct ConvEntries;
template <>
struct ConvEntries<float> {
  static constexpr auto decode = decode_f32;
  static constexpr auto chunk = chunk_f32;
};
template <>
struct ConvEntries<bf16_t> {
  static constexpr auto decode = decode_bf16;
  static constexpr auto chunk = chunk_bf16;
};
template <>
struct ConvEntries<f16_t> {
  static constexpr auto decode = decode_f16;
  static constexpr auto chunk = chunk_f16;
};

// A NaN with its low half cleared and its quiet bit set (see kNaNs): still a NaN of the same
// sign, now one the bf16 roundings can take without a select.
inline float nan_low_half_zero(float x) {
  if (x == x) return x;
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u & 0xFFFF0000u) | 0x00400000u;
  std::memcpy(&x, &u, sizeof(u));
  return x;
}

// The weights as K fp32 rows of C, each in the block layout of activation type T: the channel
// loop walks chunks of kChunk (a multiple of simd::kBlock), so its blocks are the row's own.
template <typename T, typename W>
void transpose_weights(const PleConvParams& p, std::vector<float>& out) {
  static_assert(kChunk % simd::kBlock == 0);
  const W* w = static_cast<const W*>(p.weights);
  out.resize(static_cast<size_t>(p.kernel_size) * p.channels);
  for (int k = 0; k < p.kernel_size; ++k) {
    for (int64_t c = 0; c < p.channels; ++c) {
      out[k * p.channels + simd::block_slot<T>(c, p.channels)] =
          nan_low_half_zero(to_float(w[c * p.weight_channel_stride + k * p.weight_tap_stride]));
    }
  }
}

// The transposed weights of recent calls. Decode runs each layer's conv once per step with the
// same weights, and transposing them every call was half the time of a one-token decode. An
// entry keeps a copy of the bytes it was made from and is reused only by a call whose weights
// hold the same bytes at the same address in the same layout: comparing C·K elements costs a
// fraction of transposing them, and weights rewritten in place, or another tensor at a freed
// address, can never be served a stale entry. Only contiguous [C, K] weights are cached (their
// bytes are one range); kWeightCacheEntries covers one entry per layer of a deep model.
constexpr size_t kWeightCacheEntries = 64;

struct TransposedWeights {
  const void* address;
  Dtype activation, weight;
  int64_t channels, kernel_size;
  std::vector<unsigned char> bytes;  // the weights as they were
  std::vector<float> transposed;
};

template <typename T>
std::shared_ptr<const TransposedWeights> transposed_weights(const PleConvParams& p) {
  const auto transpose = [&](std::vector<float>& out) {
    if (p.weight_dtype == Dtype::kF32) {
      transpose_weights<T, float>(p, out);
    } else {
      transpose_weights<T, T>(p, out);
    }
  };
  const size_t nbytes = static_cast<size_t>(p.channels) * p.kernel_size *
                        (p.weight_dtype == Dtype::kF32 ? sizeof(float) : sizeof(T));
  const bool contiguous = p.weight_tap_stride == 1 && p.weight_channel_stride == p.kernel_size;
  if (!contiguous || nbytes == 0) {  // (no channels: the weights may be a null pointer)
    auto entry = std::make_shared<TransposedWeights>();
    transpose(entry->transposed);
    return entry;
  }
  const auto matches = [&](const TransposedWeights& e) {
    return e.address == p.weights && e.activation == p.dtype && e.weight == p.weight_dtype &&
           e.channels == p.channels && e.kernel_size == p.kernel_size;
  };
  static std::mutex mutex;
  static std::vector<std::shared_ptr<const TransposedWeights>> cache;  // oldest first
  std::shared_ptr<const TransposedWeights> found;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    for (const auto& e : cache) {
      if (matches(*e)) found = e;
    }
  }
  if (found != nullptr && std::memcmp(found->bytes.data(), p.weights, nbytes) == 0) return found;
  auto entry = std::make_shared<TransposedWeights>();
  entry->address = p.weights;
  entry->activation = p.dtype;
  entry->weight = p.weight_dtype;
  entry->channels = p.channels;
  entry->kernel_size = p.kernel_size;
  const auto* raw = static_cast<const unsigned char*>(p.weights);
  entry->bytes.assign(raw, raw + nbytes);
  transpose(entry->transposed);
  const std::lock_guard<std::mutex> lock(mutex);
  cache.erase(
      std::remove_if(cache.begin(), cache.end(), [&](const auto& e) { return matches(*e); }),
      cache.end());
  if (cache.size() == kWeightCacheEntries) cache.erase(cache.begin());
  cache.push_back(entry);
  return entry;
}

template <typename T>
void ple_conv_cpu_impl(const PleConvParams& p) {
  const std::shared_ptr<const TransposedWeights> weights = transposed_weights<T>(p);
  const std::vector<T> zeros(p.channels, from_float<T>(0.0f));
  const float* silu = nullptr;
  if constexpr (!std::is_same_v<T, float>) silu = silu_table<T>();
  const LookupFn lookup = silu == nullptr ? nullptr : current_lookup();
  const ConvCtx<T> ctx{p, weights->transposed.data(), zeros.data(), silu, lookup};
  // A token is C channels of up to K + 3 rows: a couple of tokens already fill a thread.
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, p.channels));
  if (p.mode == ConvMode::kDecode) {
    cpu::parallel_for(0, p.num_rows, grain,
                      [&](int64_t begin, int64_t end) { ConvEntries<T>::decode(ctx, begin, end); });
    return;
  }
  cpu::parallel_for(0, p.num_rows, grain,
                    [&](int64_t begin, int64_t end) { ConvEntries<T>::chunk(ctx, begin, end); });
  // Every output has read the old state; now the state moves on.
  cpu::parallel_for(0, p.num_requests, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) write_back_request(ctx, r);
  });
}

}  // namespace

int64_t cpu_conv_silu_lookup() {
  return current_lookup() == lookup_scalar ? kConvSiluLoop : kConvSiluGather;
}

int64_t set_cpu_conv_silu_lookup(int64_t lookup) {
  if (lookup != kConvSiluTimed && lookup != kConvSiluLoop && lookup != kConvSiluGather) {
    throw std::invalid_argument(
        "set_cpu_conv_silu_lookup: lookup must be -1 (timed), 0 (loop) "
        "or 1 (gather), got " +
        std::to_string(lookup));
  }
  if (lookup == kConvSiluGather && !has_gather_lookup()) {
    throw std::invalid_argument(
        "set_cpu_conv_silu_lookup: the gather lookup needs AVX-512, which this CPU or build lacks");
  }
  return silu_lookup_setting.exchange(lookup);
}

void run_ple_conv_cpu(const PleConvParams& p) {
  if (p.num_rows == 0 && p.num_requests == 0) return;
  dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto dtype) { ple_conv_cpu_impl<typename decltype(dtype)::type>(p); },
      [] { throw std::invalid_argument("ple_conv: no CPU kernel for this dtype"); });
}

}  // namespace qwen4exp
