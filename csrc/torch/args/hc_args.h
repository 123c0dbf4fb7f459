// What the hyper-connection ops' argument checks share (hc_norm_args.h, hc_mix_args.h): the
// checks of a row-major activation, of hc_count, eps and a norm weight, and of caller-provided
// outputs. Metadata only (dtype, rank, shape, strides, device); the messages name the op and the
// argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "tensor_args.h"

namespace qwen4exp::hc_args {

// The most elements of a stream or group (the kernels index a row in 32 bits).
constexpr int64_t kMaxWidth = int64_t{1} << 24;
// The most streams (the HIP launchers take every stream of a token in one launch).
constexpr int64_t kMaxStreams = int64_t{1} << 16;

using Named = std::pair<const char*, const at::Tensor*>;

// A 2-D activation's dtype (fp32, bf16 or fp16).
inline Dtype activation_dtype(const char* op, const char* name, const at::Tensor& t) {
  Dtype d{};
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
  TORCH_CHECK(float_dtype_of(t.scalar_type(), &d), op, ": ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
  return d;
}

// Each tensor: first's dtype and device, a row-major view (unit stride along the row, a
// non-negative row stride).
inline void check_rows_like(const char* op, const Named& first, std::initializer_list<Named> rest) {
  const at::Tensor& f = *first.second;
  for (const auto& [name, t] : rest) {
    TORCH_CHECK(t->scalar_type() == f.scalar_type(), op, ": ", name, " must have ", first.first,
                "'s dtype ", f.scalar_type(), ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == f.device(), op, ": ", name, " is on ", t->device(), " but ",
                first.first, " is on ", f.device());
  }
  const auto check_strides = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
    TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name,
                " must have unit stride along its last dim (a row-major view), got strides ",
                t.strides());
    TORCH_CHECK(t.stride(0) >= 0, op, ": ", name, " must have a non-negative row stride, got ",
                t.strides());
  };
  check_strides(first.first, f);
  for (const auto& [name, t] : rest) check_strides(name, *t);
}

inline int32_t check_hc_count(const char* op, const char* name, int64_t hc_count) {
  TORCH_CHECK(hc_count >= 1 && hc_count <= kMaxStreams, op, ": ", name, " must be in [1, ",
              kMaxStreams, "], got ", hc_count);
  return static_cast<int32_t>(hc_count);
}

// The width of each of `count` parts of a row of `columns`: a positive whole number, at most
// kMaxWidth.
inline int32_t part_width(const char* op, const char* what, int64_t columns, int64_t count,
                          const char* count_name) {
  TORCH_CHECK(columns > 0 && columns % count == 0, op, ": ", what, " = ", columns,
              " must be a positive multiple of ", count_name, " = ", count);
  TORCH_CHECK(columns / count <= kMaxWidth, op, ": ", what, " / ", count_name, " = ",
              columns / count, " is more than the supported 2^24");
  return static_cast<int32_t>(columns / count);
}

// eps reaches the kernels as fp32 (as vLLM's constexpr); rounding to 0 there (or inf/NaN) would
// give inf/NaN rows instead of an error.
inline float check_eps(const char* op, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0.0 && std::isfinite(static_cast<float>(eps)) &&
                  static_cast<float>(eps) > 0.0f,
              op, ": eps must be a positive finite number (also in fp32), got ", eps);
  return static_cast<float>(eps);
}

// A norm weight: 1-D, contiguous, [width] (shared by every part: returns true) or
// [parts·width], fp32 or the activations' dtype, on their device.
inline bool check_norm_weight(const char* op, const char* name, const at::Tensor& w,
                              const at::Tensor& x, int64_t width, int64_t parts,
                              Dtype* weight_dtype) {
  TORCH_CHECK(float_dtype_of(w.scalar_type(), weight_dtype) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == x.scalar_type()),
              op, ": ", name, " must be float32 or the activations' dtype ", x.scalar_type(),
              ", got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && (w.size(0) == width || w.size(0) == width * parts), op, ": ", name,
              " must be [", width, "] (shared) or [", width * parts, "], got shape ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(w.device() == x.device(), op, ": ", name, " is on ", w.device(),
              " but the "
              "activations are on ",
              x.device());
  return w.size(0) == width;
}

// A caller-provided output: `shape`, `like`'s dtype and device, unit stride along the row.
inline void check_output(const char* op, const char* name, const at::Tensor& out,
                         at::IntArrayRef shape, const at::Tensor& like) {
  TORCH_CHECK(out.dim() == 2 && out.sizes() == shape, op, ": ", name, " must be ", shape, ", got ",
              out.sizes());
  TORCH_CHECK(out.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype ",
              like.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, op, ": ", name,
              " must have unit stride along its last dim, got strides ", out.strides());
  TORCH_CHECK(out.size(0) <= 1 || out.stride(0) >= out.size(1), op, ": ", name,
              " must not overlap itself (row stride >= row length), got strides ", out.strides());
  TORCH_CHECK(out.device() == like.device(), op, ": ", name, " is on ", out.device(),
              " but the inputs are on ", like.device());
}

}  // namespace qwen4exp::hc_args
