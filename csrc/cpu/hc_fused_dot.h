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

}  // namespace qwen4exp::cpu
