// Runtime dtype tags to template instantiations, for every launcher and CPU entry point: one
// place instead of a switch ladder per op and backend. Host code only (launchers, CPU entries).
//
//   dispatch_dtype(kFloatDtypes, p.dtype, [&](auto t) { return run<decltype(t)::kDtype>(p); },
//                  [] { return kInvalidValue; });
//
// calls the first lambda with DtypeTag<D> for the D of the list equal to p.dtype, and the second
// (whose return type both share) when none is: the argument checks have already rejected such a
// dtype, so that is a guard, not a path.
#pragma once

#include <type_traits>
#include <utility>

#include "float_types.h"

namespace qwen4exp {

template <Dtype... Ds>
struct Dtypes {};

// The activations' (and gather outputs') formats, and every gather table format.
constexpr Dtypes<Dtype::kF32, Dtype::kBF16, Dtype::kF16> kFloatDtypes{};
constexpr Dtypes<Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kFp8E4M3FN, Dtype::kFp8E4M3FNUZ,
                 Dtype::kNvfp4>
    kTableDtypes{};

template <Dtype D>
struct DtypeTag {
  static constexpr Dtype kDtype = D;
  using type = storage_t<D>;
};

template <Dtype... Ds, typename Fn, typename Otherwise>
auto dispatch_dtype(Dtypes<Ds...>, Dtype dtype, Fn&& fn, Otherwise&& otherwise)
    -> decltype(otherwise()) {
  using Result = decltype(otherwise());
  if constexpr (std::is_void_v<Result>) {
    const bool found = ((dtype == Ds ? (fn(DtypeTag<Ds>{}), true) : false) || ...);
    if (!found) otherwise();
  } else {
    Result result{};
    const bool found = ((dtype == Ds ? (result = fn(DtypeTag<Ds>{}), true) : false) || ...);
    if (!found) result = otherwise();
    return result;
  }
}

}  // namespace qwen4exp
