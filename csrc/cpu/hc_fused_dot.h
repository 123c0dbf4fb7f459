// The skinny products of the fused hyper-connection projections (hc_fused.cpp): fp32 dots of a
// few activation rows with many weight rows, each weight row read once for all of them. Internal
// to the CPU kernels.
#pragma once

#include <cstdint>

#include "../common/float_types.h"

namespace qwen4exp::cpu {

constexpr int kDotLanes = 16;

// out[t · out_stride + r] = Σ_{k < depth} a[t · a_stride + k] · w[r · w_stride + k] in fp32, for
// t < tokens and r < rows. `a` is fp32 and zero from `depth` to the next multiple of kDotLanes
// (its rows are read in whole vectors); w is fp32, bf16 or fp16 (`w_dtype`). Each dot is summed
// in the same order whatever tokens and rows are (kDotLanes interleaved partial sums over k, added
// in a fixed tree): a result does not depend on the batch it was computed in, or on the threads.
void dot_rows(const float* a, int64_t a_stride, int64_t tokens, const void* w, int64_t w_stride,
              Dtype w_dtype, int64_t rows, int64_t depth, float* out, int64_t out_stride);

// Whether dot_rows_bf16 runs on this CPU: x86-64 with AVX512-BF16 (Zen 4, Sapphire Rapids on);
// whether the kernels use it for bf16 data (set_cpu_hc_dot, hc_fused.h; by default where it runs).
bool has_bf16_dot();
bool use_bf16_dot();
constexpr int kBf16DotLanes = 32;

// dot_rows for bf16 activations and weights on AVX512-BF16's vdpbf16ps: 32 products a
// instruction where dot_rows' fp32 FMAs take 16, after two conversions of each weight vector
// (4x the products per instruction: the dots, not the weights' bytes, bound a decode step from
// T ~ 4 on). `a` is zero from `depth` to the next multiple of kBf16DotLanes. The products of two
// bf16 values are exact in fp32 and summed in fp32 (16 lanes, each adding its pairs in order,
// then lane_sums' tree: the same order whatever the batch or the threads), with the instruction's
// fixed treatment of denormals: a bf16 input below 2^-126 counts as 0 and a denormal sum is
// flushed to 0 (values no model's activations or weights take; within the fused ops' stated
// tolerance otherwise). Only where has_bf16_dot().
void dot_rows_bf16(const bf16_t* a, int64_t a_stride, int64_t tokens, const bf16_t* w,
                   int64_t w_stride, int64_t rows, int64_t depth, float* out, int64_t out_stride);

}  // namespace qwen4exp::cpu
