// sigmoid(x) for every 16-bit pattern x of T (bf16 or fp16): vLLM's fp32 formula with a correctly
// rounded exp (float_types.h's sigmoid_f32, the GPU kernels' own), computed once per process.
// The CPU kernels that take the sigmoid of a stored 16-bit value (hc_gate_mix, hc_up_gate_mix)
// look it up here: exact where simd.h's polynomial exp is ~1 ulp, and a load where it is some 20
// vector operations and a division per eight values.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/float_types.h"

namespace qwen4exp::cpu {

template <typename T>
const float* sigmoid_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      t[bits] = sigmoid_f32(to_float(T{static_cast<uint16_t>(bits)}));
    }
    return t;
  }();
  return table.data();
}

}  // namespace qwen4exp::cpu
