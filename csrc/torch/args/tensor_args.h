// What every op's argument checks share (torch side; the per-op checks are
// csrc/torch/args/<op>_args.h): the one mapping from torch dtypes to the kernels' Dtype tags, and
// index tensors as IndexViews.
//
// The torch glue includes ATen's own headers for what it uses (ATen/core/Tensor.h, ATen/ops/<op>.h,
// torch/library.h), never torch/all.h: that is the whole C++ frontend (nn, optim, data, jit), and
// each file that included it took 3-4x as long to compile. tools/check-format.sh enforces it.
#pragma once

#include <ATen/core/Tensor.h>

#include "../../common/float_types.h"
#include "../../common/index_view.h"

namespace qwen4exp {

// The kernels' tag of a torch dtype; false for a dtype no kernel reads. uint8 is NVFP4: the only
// uint8 data a kernel reads as elements is a packed NVFP4 table.
inline bool dtype_of(at::ScalarType t, Dtype* out) {
  switch (t) {
    case at::kFloat: *out = Dtype::kF32; return true;
    case at::kBFloat16: *out = Dtype::kBF16; return true;
    case at::kHalf: *out = Dtype::kF16; return true;
    case at::kFloat8_e4m3fn: *out = Dtype::kFp8E4M3FN; return true;
    case at::kFloat8_e4m3fnuz: *out = Dtype::kFp8E4M3FNUZ; return true;
    case at::kByte: *out = Dtype::kNvfp4; return true;
    default: return false;
  }
}

// The same for activations and outputs: fp32, bf16 or fp16 only.
inline bool float_dtype_of(at::ScalarType t, Dtype* out) {
  return dtype_of(t, out) && is_float_dtype(*out);
}

// A 1-D index tensor (or a [n, 1] column view) as the kernels read it: along dim 0, with the
// element size of its dtype (the caller has checked the dtype).
inline IndexView index_view(const at::Tensor& t) {
  return IndexView{t.data_ptr(), t.dim() > 0 && t.size(0) > 1 ? t.stride(0) : 1,
                   static_cast<int32_t>(t.element_size())};
}

}  // namespace qwen4exp
