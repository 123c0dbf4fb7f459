// HIP kernels of the fused hyper-connection projections (csrc/common/hc_fused.h, issue #50 item
// 3): hc_up_gate_mix and hc_down_silu_inject. Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA; 32 lanes per weight row, so the same code serves 64-wide waves (two
// rows a wave) and 32-wide ones (one).
//
// A group of 32 lanes takes one weight row at a time and a tile of up to kTileTokens tokens: each
// lane sums the products of every 32nd column in fp32 (consecutive lanes read consecutive
// columns: each step of the group is one contiguous run of the row), then the group adds its lanes
// by block_reduce.h's butterfly, and every lane holds the tile's dots. The weights are read once
// per token tile (decode: once), the activations from the caches.
//   up:   a group owns one column i of H and walks the HC streams' rows s·H + i in order, adding
//         sigmoid_f32(round(dot)) · xn to fp32 sums: hc_gate_mix's math, the gate never stored.
//         One launch, where vLLM's path has the up GEMM and hc_gate_mix.
//   down: split-K (K = HC·H = 10240 but only R + HC = 324 rows: too few blocks for a GPU without
//         it): each block sums a slice of kHcDownSliceColumns columns for 8 rows into the fp32
//         workspace; a second kernel adds the slices in order (deterministic, no atomics) and
//         applies hc_silu's math to the down rows and the rounding to the inject rows.
// Every loop over a block's work is uniform in the block (rows past the end are clamped, their
// results discarded), so every lane reaches every shuffle. No a·b+c contracted (setup.py's
// device flags); results differ from the CPU kernels' only in the dots' summation order.
#include <algorithm>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/hc_fused.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;
// The fewest waves per SIMD on AMD: the op's floor in tools/kernel_report.py (FLOORS). 4, not the
// element-wise ops' 8: at 8 the register budget spilled scalar registers (the 64-bit row
// addressing of the dots, and sigmoid_f32's double exp in the up kernel); a decode step has a
// few hundred blocks of these kernels at most, far from filling 8 waves a SIMD anyway.
constexpr int kAmdMinWaves = 4;
constexpr int kGroupLog2 = 5;
constexpr int kGroup = 1 << kGroupLog2;   // lanes per weight row
constexpr int kRows = kThreads / kGroup;  // weight rows (up: columns of H) per block
constexpr int kTileTokens = 4;            // tokens per pass over a row

// The dots of w[begin, end) with the tile's activation rows a + j·a_stride (j < kTile; those
// past `tokens` repeat the last one), summed over the group: every lane gets them.
template <typename T, int kTile>
QWEN4EXP_DEVICE void group_dots(const T* w, const T* a, int64_t a_stride, int tokens, int64_t begin,
                                int64_t end, float (&dot)[kTile]) {
  const int lane = threadIdx.x % kGroup;
#pragma unroll
  for (int j = 0; j < kTile; ++j) dot[j] = 0.f;
  for (int64_t k = begin + lane; k < end; k += kGroup) {
    const float wk = widen(w[k]);
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      dot[j] += wk * widen(a[std::min(j, tokens - 1) * a_stride + k]);
    }
  }
  group_sum<kTile, kThreads>(dot, kGroupLog2, nullptr);  // a group never spans waves
}

template <typename T>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_up_gate_mix_kernel(HcUpGateMixParams p, int64_t column_blocks) {
  const int lane = threadIdx.x % kGroup;
  const int64_t width = p.width;
  const float hc = static_cast<float>(p.streams);
  for (int64_t cb = blockIdx.x; cb < column_blocks; cb += gridDim.x) {
    const int64_t i = cb * kRows + threadIdx.x / kGroup;
    const int64_t column = std::min(i, width - 1);
    for (int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileTokens; t0 < p.num_tokens;
         t0 += static_cast<int64_t>(gridDim.y) * kTileTokens) {
      const int tokens = static_cast<int>(std::min<int64_t>(kTileTokens, p.num_tokens - t0));
      const T* lowrank = static_cast<const T*>(p.lowrank) + t0 * p.lowrank_row_stride;
      // Lane j (< kTileTokens) of the group owns token t0 + j's sum: one sigmoid a lane per
      // stream, not one per token unrolled (sigmoid_f32's double exp, inlined kTileTokens
      // times, spilled the scalar registers on AMD).
      const int mine = std::min(lane, tokens - 1);
      const T* xn = static_cast<const T*>(p.xn) + (t0 + mine) * p.xn_row_stride;
      float acc = 0.f;
      for (int s = 0; s < p.streams; ++s) {
        const int64_t row = s * width + column;
        float dot[kTileTokens];
        group_dots(static_cast<const T*>(p.w_up) + row * p.w_row_stride, lowrank,
                   p.lowrank_row_stride, tokens, 0, p.rank, dot);
        float gate = dot[0];
#pragma unroll
        for (int j = 1; j < kTileTokens; ++j) gate = mine == j ? dot[j] : gate;
        acc += sigmoid_f32(round_through<T>(gate)) * widen(xn[row]);
      }
      if (i < width && lane < tokens) {
        static_cast<T*>(p.out)[(t0 + lane) * p.out_row_stride + i] = narrow<T>(acc / hc);
      }
    }
  }
}

// Slice partial sums: workspace[(slice · T + t) · rows + r], rows = R (+ HC with w_inj).
template <typename T>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_down_partial_kernel(HcDownSiluInjectParams p, int64_t row_blocks, int32_t rows,
                           int32_t slices) {
  const int lane = threadIdx.x % kGroup;
  for (int64_t rb = blockIdx.x; rb < row_blocks; rb += gridDim.x) {
    const int64_t r = rb * kRows + threadIdx.x / kGroup;
    const int64_t row = std::min<int64_t>(r, rows - 1);
    const T* w = row < p.rank
                     ? static_cast<const T*>(p.w_down) + row * p.w_down_row_stride
                     : static_cast<const T*>(p.w_inj) + (row - p.rank) * p.w_inj_row_stride;
    for (int64_t slice = blockIdx.y; slice < slices; slice += gridDim.y) {
      const int64_t begin = slice * kHcDownSliceColumns;
      const int64_t end = std::min<int64_t>(begin + kHcDownSliceColumns, p.depth);
      for (int64_t t0 = static_cast<int64_t>(blockIdx.z) * kTileTokens; t0 < p.num_tokens;
           t0 += static_cast<int64_t>(gridDim.z) * kTileTokens) {
        const int tokens = static_cast<int>(std::min<int64_t>(kTileTokens, p.num_tokens - t0));
        float dot[kTileTokens];
        group_dots(w, static_cast<const T*>(p.xn) + t0 * p.xn_row_stride, p.xn_row_stride, tokens,
                   begin, end, dot);
        if (r < rows && lane == 0) {
          for (int j = 0; j < tokens; ++j) {
            p.workspace[(slice * p.num_tokens + t0 + j) * rows + r] = dot[j];
          }
        }
      }
    }
  }
}

// One thread per (token, row): the slices added in order, then the epilogue.
template <typename T>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    hc_down_finish_kernel(HcDownSiluInjectParams p, int32_t rows, int32_t slices) {
  const int64_t total = p.num_tokens * rows;
  const float hc = static_cast<float>(p.streams);
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = index / rows;
    const int64_t r = index - t * rows;
    float sum = 0.f;
    for (int64_t slice = 0; slice < slices; ++slice) {
      sum += p.workspace[(slice * p.num_tokens + t) * rows + r];
    }
    if (r < p.rank) {
      const float z = round_through<T>(sum) / hc;
      static_cast<T*>(p.lowrank)[t * p.lowrank_row_stride + r] = narrow<T>(z * sigmoid_f32(z));
    } else {
      static_cast<T*>(p.logits)[t * p.logits_row_stride + (r - p.rank)] = narrow<T>(sum);
    }
  }
}

template <typename F>
hipError_t dispatch_float(Dtype dtype, const F& launch) {
  return dispatch_dtype(
      kFloatDtypes, dtype, [&](auto tag) { return launch(typename decltype(tag)::type{}); },
      [] { return hipErrorInvalidValue; });
}

unsigned grid_size(int64_t blocks, int64_t most) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, most)));
}

}  // namespace

hipError_t launch_hc_up_gate_mix(const HcUpGateMixParams& p, hipStream_t stream) {
  return dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t column_blocks = (int64_t{p.width} + kRows - 1) / kRows;
    const int64_t token_tiles = (p.num_tokens + kTileTokens - 1) / kTileTokens;
    const dim3 grid(grid_size(column_blocks, kMaxGridX), grid_size(token_tiles, kMaxGridY));
    return launch_kernel(hc_up_gate_mix_kernel<T>, grid, dim3(kThreads), 0, stream, p,
                         column_blocks);
  });
}

hipError_t launch_hc_down_silu_inject(const HcDownSiluInjectParams& p, hipStream_t stream) {
  return dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int32_t rows = p.rank + (p.w_inj != nullptr ? p.streams : 0);
    const int32_t slices = (p.depth + kHcDownSliceColumns - 1) / kHcDownSliceColumns;
    const int64_t row_blocks = (int64_t{rows} + kRows - 1) / kRows;
    const int64_t token_tiles = (p.num_tokens + kTileTokens - 1) / kTileTokens;
    const dim3 grid(grid_size(row_blocks, kMaxGridX), grid_size(slices, kMaxGridY),
                    grid_size(token_tiles, kMaxGridY));
    hipError_t status = launch_kernel(hc_down_partial_kernel<T>, grid, dim3(kThreads), 0, stream, p,
                                      row_blocks, rows, slices);
    if (status != hipSuccess) return status;
    const int64_t finish_blocks = (p.num_tokens * rows + kThreads - 1) / kThreads;
    return launch_kernel(hc_down_finish_kernel<T>, dim3(grid_size(finish_blocks, kMaxGridX)),
                         dim3(kThreads), 0, stream, p, rows, slices);
  });
}

}  // namespace qwen4exp
