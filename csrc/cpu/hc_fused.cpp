// CPU kernels of the fused hyper-connection projections (csrc/common/hc_fused.h, issue #50 item
// 3): hc_up_gate_mix and hc_down_silu_inject. The products are hc_fused_dot.cpp's (each weight
// row read once for a tile of up to 16 tokens); the epilogues here apply exactly the element-wise
// ops' fp32 math to each dot rounded to the dtype, as the vendor GEMM would have written it:
//   up:   hc_gate_mix's: sigmoid of the rounded gate (16-bit: hc_sigmoid_table.h, the GPU's
//         sigmoid_f32; fp32: sigmoid_f32 itself), times xn, summed over the streams in order from
//         0, divided by HC, rounded. The gate tensor is never written.
//   down: hc_silu's z = round(dot) / HC, z · sigmoid_f32(z) (the GPU kernels' correctly rounded
//         exp); the inject rows' dots rounded.
// Parallel over blocks of output columns (up: 16 columns of H, every stream; down: 8 of the
// R + HC rows), so that each thread reads its own part of the weights, once.

// No a*b+c contracted into an FMA in the epilogues: vLLM's order of roundings (see hc_mix.cpp).
#if defined(__GNUC__) && !defined(__clang__) && !defined(QWEN4EXP_TEST_NOPRAGMA)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/hc_fused.h"
#include "hc_fused_dot.h"
#include "hc_sigmoid_table.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace {

constexpr int64_t kTokenTile = 16;  // tokens a weight row is read for at once (decode: all)
constexpr int64_t kUpColumns = 16;  // columns of H per up block (16·HC weight rows)
static_assert(kUpColumns % simd::kLanes == 0, "the epilogue takes whole 8-column vectors");
constexpr int64_t kDownRows = 8;  // weight rows per down block

int64_t padded(int64_t n) { return (n + cpu::kDotLanes - 1) / cpu::kDotLanes * cpu::kDotLanes; }

// rows × depth activations of T (row stride `stride`) widened to fp32 [rows, padded(depth)],
// zero past depth (hc_fused_dot.h's `a`), in parallel over the rows.
template <typename T>
std::vector<float> widen_rows(const void* src, int64_t stride, int64_t rows, int64_t depth) {
  const int64_t width = padded(depth);
  std::vector<float> a(static_cast<size_t>(rows * width), 0.f);
  cpu::parallel_for(0, rows, std::max<int64_t>(1, 65536 / width), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = static_cast<const T*>(src) + t * stride;
      float* dst = a.data() + t * width;
      for (int64_t k = 0; k < depth; k += simd::kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(simd::kLanes, depth - k));
        simd::store_n(dst + k, simd::load_n(row + k, n), n);
      }
    }
  });
  return a;
}

// The activation rows the dots read: on a CPU with AVX512-BF16 and bf16 data, the bf16 rows
// themselves, zero-padded (hc_fused_dot.h's dot_rows_bf16); else widened to fp32 (dot_rows).
struct Activations {
  std::vector<float> f32;
  std::vector<bf16_t> b16;
  int64_t width = 0;  // padded row length
  bool bf16 = false;

  // dot_rows of tokens [t0, t0 + nt) with `rows` weight rows of `depth`.
  void dots(int64_t t0, int64_t nt, const void* w, int64_t w_stride, Dtype w_dtype, int64_t rows,
            int64_t depth, float* out, int64_t out_stride) const {
    if (bf16) {
      cpu::dot_rows_bf16(b16.data() + t0 * width, width, nt, static_cast<const bf16_t*>(w),
                         w_stride, rows, depth, out, out_stride);
    } else {
      cpu::dot_rows(f32.data() + t0 * width, width, nt, w, w_stride, w_dtype, rows, depth, out,
                    out_stride);
    }
  }
};

template <typename T>
Activations activations(const void* src, int64_t stride, int64_t rows, int64_t depth) {
  Activations acts;
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (cpu::use_bf16_dot()) {
      constexpr int64_t kPad = cpu::kBf16DotLanes;
      acts.bf16 = true;
      acts.width = (depth + kPad - 1) / kPad * kPad;
      acts.b16.assign(static_cast<size_t>(rows * acts.width), bf16_t{0});
      for (int64_t t = 0; t < rows; ++t) {
        std::memcpy(static_cast<void*>(acts.b16.data() + t * acts.width),
                    static_cast<const bf16_t*>(src) + t * stride, sizeof(bf16_t) * depth);
      }
      return acts;
    }
  }
  acts.width = padded(depth);
  acts.f32 = widen_rows<T>(src, stride, rows, depth);
  return acts;
}

// The sigmoids of 8 dots (n valid) as the unfused path takes them: of each dot rounded to T.
// 16-bit: looked up by the rounded bits (hc_sigmoid_table.h); fp32: sigmoid_f32 itself.
template <typename T>
simd::f32x8 gate_sigmoids(simd::f32x8 dots, [[maybe_unused]] const float* table) {
  simd::f32x8 out;
  if constexpr (sizeof(T) == 2) {
    const simd::u16x8 bits = simd::to_bits<T>(dots);
    for (int j = 0; j < simd::kLanes; ++j) out[j] = table[bits[j]];
  } else {
    for (int j = 0; j < simd::kLanes; ++j) out[j] = sigmoid_f32(dots[j]);
  }
  return out;
}

// One block of columns [c0, c0 + columns) of every token: per stream, the dots of its weight
// rows, then acc += sigmoid(gate) · xn in 8-column vectors (hc_gate_mix's fp32 operations, in
// its order: the streams from 0, then one division by HC).
template <typename T>
void up_gate_mix_block(const HcUpGateMixParams& p, const Activations& acts, int64_t c0,
                       const float* table) {
  const int64_t tokens = p.num_tokens, width = p.width;
  const int64_t columns = std::min(kUpColumns, width - c0);
  const float hc = static_cast<float>(p.streams);
  float dots[kTokenTile * kUpColumns] = {};  // columns past the block: finite, never stored
  float acc[kTokenTile * kUpColumns];
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
    const int64_t nt = std::min(kTokenTile, tokens - t0);
    std::fill(acc, acc + kTokenTile * kUpColumns, 0.f);
    for (int s = 0; s < p.streams; ++s) {
      const int64_t row0 = s * width + c0;
      acts.dots(t0, nt, static_cast<const T*>(p.w_up) + row0 * p.w_row_stride, p.w_row_stride,
                p.dtype, columns, p.rank, dots, kUpColumns);
      for (int64_t t = 0; t < nt; ++t) {
        const T* x = static_cast<const T*>(p.xn) + (t0 + t) * p.xn_row_stride + row0;
        for (int64_t c = 0; c < columns; c += simd::kLanes) {
          const int n = static_cast<int>(std::min<int64_t>(simd::kLanes, columns - c));
          float* at = acc + t * kUpColumns + c;
          const simd::f32x8 sig = gate_sigmoids<T>(simd::load(dots + t * kUpColumns + c), table);
          simd::store(at, simd::load(at) + sig * simd::load_n(x + c, n));
        }
      }
    }
    for (int64_t t = 0; t < nt; ++t) {
      T* out = static_cast<T*>(p.out) + (t0 + t) * p.out_row_stride + c0;
      for (int64_t c = 0; c < columns; c += simd::kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(simd::kLanes, columns - c));
        simd::store_n(out + c, simd::load(acc + t * kUpColumns + c) / hc, n);
      }
    }
  }
}

template <typename T>
void up_gate_mix(const HcUpGateMixParams& p) {
  const Activations acts = activations<T>(p.lowrank, p.lowrank_row_stride, p.num_tokens, p.rank);
  const float* table = nullptr;
  if constexpr (sizeof(T) == 2) table = cpu::sigmoid_table<T>();
  const int64_t blocks = (p.width + kUpColumns - 1) / kUpColumns;
  cpu::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      up_gate_mix_block<T>(p, acts, b * kUpColumns, table);
    }
  });
}

template <typename T>
void down_silu_inject(const HcDownSiluInjectParams& p) {
  const int64_t tokens = p.num_tokens, depth = p.depth;
  const Activations acts = activations<T>(p.xn, p.xn_row_stride, tokens, depth);
  const float hc = static_cast<float>(p.streams);
  const int64_t down_blocks = (p.rank + kDownRows - 1) / kDownRows;
  const int64_t inject_blocks = p.w_inj != nullptr ? (p.streams + kDownRows - 1) / kDownRows : 0;
  cpu::parallel_for(0, down_blocks + inject_blocks, 1, [&](int64_t b0, int64_t b1) {
    float dots[kTokenTile * kDownRows];
    for (int64_t b = b0; b < b1; ++b) {
      const bool down = b < down_blocks;
      const int64_t r0 = (down ? b : b - down_blocks) * kDownRows;
      const int64_t rows = std::min<int64_t>(kDownRows, (down ? p.rank : p.streams) - r0);
      const int64_t w_stride = down ? p.w_down_row_stride : p.w_inj_row_stride;
      const T* w = static_cast<const T*>(down ? p.w_down : p.w_inj) + r0 * w_stride;
      for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
        const int64_t nt = std::min(kTokenTile, tokens - t0);
        acts.dots(t0, nt, w, w_stride, p.dtype, rows, depth, dots, kDownRows);
        for (int64_t t = 0; t < nt; ++t) {
          const float* d = dots + t * kDownRows;
          if (down) {
            T* y = static_cast<T*>(p.lowrank) + (t0 + t) * p.lowrank_row_stride + r0;
            for (int64_t r = 0; r < rows; ++r) {
              const float z = round_to<T>(d[r]) / hc;
              y[r] = from_float<T>(z * sigmoid_f32(z));
            }
          } else {
            T* y = static_cast<T*>(p.logits) + (t0 + t) * p.logits_row_stride + r0;
            for (int64_t r = 0; r < rows; ++r) y[r] = from_float<T>(d[r]);
          }
        }
      }
    }
  });
}

template <typename P, typename F>
void dispatch(const char* op, const P& p, const F& run) {
  switch (p.dtype) {
    case Dtype::kF32: return run(float{});
    case Dtype::kBF16: return run(bf16_t{});
    case Dtype::kF16: return run(f16_t{});
    default: throw std::invalid_argument(std::string(op) + ": no CPU kernel for this dtype");
  }
}

}  // namespace

void run_hc_up_gate_mix_cpu(const HcUpGateMixParams& p) {
  if (p.num_tokens == 0) return;
  dispatch("hc_up_gate_mix", p, [&](auto tag) { up_gate_mix<decltype(tag)>(p); });
}

void run_hc_down_silu_inject_cpu(const HcDownSiluInjectParams& p) {
  if (p.num_tokens == 0) return;
  dispatch("hc_down_silu_inject", p, [&](auto tag) { down_silu_inject<decltype(tag)>(p); });
}

}  // namespace qwen4exp
