// The fused decode projections of a hyper-connection module (issue #50 item 3): the up GEMM with
// hc_gate_mix as its epilogue (hc_up_gate_mix), and the down and inject GEMMs with hc_silu as
// the down rows' epilogue (hc_down_silu_inject). At decode (T <= 16) the weights dominate a
// module's bytes; these read each weight once for all T tokens and never write the GEMMs'
// outputs that the element-wise ops would read back (the gate [T, HC·H] above all). The params
// structs shared by the CPU kernels, the HIP kernels and the host glue, and the launchers.
// Torch-free.
//
// Precision, as vLLM's unfused path (vendor GEMM, then hc_gate_mix / hc_silu, hc_mix.h): each
// projection is an fp32 dot rounded to the dtype (as the vendor GEMM writes it), then exactly the
// element-wise op's fp32 math. Only the dot's summation order is ours (no BLAS has one to match):
// the result can differ from the unfused path's by a unit in the last place where a dot lands
// next to a rounding boundary (testing.TOLERANCES).
#pragma once

#include "float_types.h"
#include "platform.h"

namespace qwen4exp {

// hc_up_gate_mix, per token t and i < H:
//   gate_s = round(Σ_k lowrank[t, k] · w_up[s·H + i, k])   (fp32 dot, rounded to the dtype)
//   out[t, i] = round((Σ_{s = 0..HC-1} sigmoid(gate_s) · xn[t, s·H + i]) / HC),
// the stream sum in fp32 from 0 in stream order (hc_gate_mix's).
struct HcUpGateMixParams {
  const void* lowrank;  // [T, R], unit stride along the row
  const void* w_up;     // [HC·H, R], unit stride along the row
  const void* xn;       // [T, HC·H], unit stride along the row
  void* out;            // [T, H], unit stride along the row
  int64_t lowrank_row_stride;
  int64_t w_row_stride;
  int64_t xn_row_stride;
  int64_t out_row_stride;
  int64_t num_tokens;  // T
  int32_t rank;        // R
  int32_t width;       // H
  int32_t streams;     // HC
  Dtype dtype;
};

// hc_down_silu_inject, per token t:
//   lowrank[t, r] = silu(round(Σ_k xn[t, k] · w_down[r, k]) / HC)   for r < R (hc_silu's math),
//   logits[t, s]  = round(Σ_k xn[t, k] · w_inj[s, k])               for s < HC (if w_inj),
// K = HC·H, each dot in fp32.
struct HcDownSiluInjectParams {
  const void* xn;      // [T, K], unit stride along the row
  const void* w_down;  // [R, K], unit stride along the row
  const void* w_inj;   // [HC, K], unit stride along the row; nullptr: no logits
  void* lowrank;       // [T, R], unit stride along the row
  void* logits;        // [T, HC], unit stride along the row (nullptr with w_inj)
  float* workspace;    // the HIP kernels' split-K partial sums (hc_down_workspace_floats)
  int64_t xn_row_stride;
  int64_t w_down_row_stride;
  int64_t w_inj_row_stride;
  int64_t lowrank_row_stride;
  int64_t logits_row_stride;
  int64_t num_tokens;  // T
  int32_t depth;       // K = HC·H
  int32_t rank;        // R
  int32_t streams;     // HC
  Dtype dtype;
};

// The HIP down kernel's K slice: each block sums this many columns of K; the slices' partial sums
// are then added in slice order by a second kernel (deterministic, unlike atomics). 2048 columns
// keep ~5 slices at K = 10240, so that R + HC = 324 rows give the GPU some hundreds of blocks.
constexpr int32_t kHcDownSliceColumns = 2048;

// The fp32 workspace the HIP down launcher needs: one partial sum per (slice, token, row).
QWEN4EXP_HD int64_t hc_down_workspace_floats(int64_t tokens, int32_t depth, int32_t rows) {
  const int64_t slices = (depth + kHcDownSliceColumns - 1) / kHcDownSliceColumns;
  return slices * tokens * rows;
}

// The CPU kernels (csrc/cpu/hc_fused.cpp), on the calling thread and the CPU kernels' threads;
// return when done. Expect R, H, K > 0 and host memory; T may be 0. The workspace is unused.
// Throw std::invalid_argument on a dtype they have no kernel for.
QWEN4EXP_API void run_hc_up_gate_mix_cpu(const HcUpGateMixParams& p);
QWEN4EXP_API void run_hc_down_silu_inject_cpu(const HcDownSiluInjectParams& p);

// How the CPU kernels take the dots of bf16 data: 1 with AVX512-BF16's vdpbf16ps (x86-64 CPUs that
// have it: 32 products an instruction), 0 in fp32 FMAs after widening (every CPU, and fp32/fp16
// data). By default 1 where the CPU has it; set_cpu_hc_dot pins one (-1: that default) and
// returns the setting it replaces; 1 where the CPU lacks it throws std::invalid_argument.
QWEN4EXP_API int64_t cpu_hc_dot();
QWEN4EXP_API int64_t set_cpu_hc_dot(int64_t dot);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueue the kernels on `stream`; return the launch status. Expect T > 0 and R, H, K > 0; the
// down launcher a workspace of hc_down_workspace_floats(T, K, R + HC or R) floats.
hipError_t launch_hc_up_gate_mix(const HcUpGateMixParams& p, hipStream_t stream);
hipError_t launch_hc_down_silu_inject(const HcDownSiluInjectParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
