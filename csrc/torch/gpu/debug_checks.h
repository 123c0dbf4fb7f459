// Opt-in debug checks for the GPU path (host glue only, also as the SIMT emulator runs it).
//
// The GPU kernels never read index data on the host: that would sync the stream on every call
// and break CUDA-graph capture. So values that only the data shows (query_start_loc layout,
// state_indices, token_indices, head sizes) are not errors there: every kernel is written so that
// such values read and write nothing out of bounds (skipped rows and slots, -1 ids that gather as
// zero rows; see each kernel). With the checks on (csrc/torch/switches.h: QWEN4EXP_DEBUG_CHECKS=1
// at import, qwen4exp_ext.set_debug_checks, or `with qwen4exp_ext.debug_checks():`), the GPU glue
// instead copies the index tensors to the host and runs the same value checks as the CPU path,
// so bad data raises the CPU's error. The copy syncs the stream; during CUDA-graph capture the
// checks are skipped (a capture cannot hold a host copy), so they run again on the next eager
// call.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "glue.h"
#include "../args/ngram_ids_args.h"
#include "../switches.h"

namespace qwen4exp {

inline bool debug_checks_enabled() { return switches::debug_checks() && !glue::capturing(); }

// Host copies of index tensors, kept alive for the duration of one check.
class HostIndexCopies {
 public:
  // A host copy of `t`; returns its data pointer and sets `stride` (elements) along dim 0.
  const void* add(const at::Tensor& t, int64_t* stride) {
    copies_.push_back(t.to(at::kCPU));
    const at::Tensor& host = copies_.back();
    *stride = host.dim() > 0 && host.size(0) > 1 ? host.stride(0) : 1;
    return host.data_ptr();
  }

 private:
  std::vector<at::Tensor> copies_;
};

// The value checks of ngram_ids' index data (check_ngram_ids_values), on host copies of the
// tensors p points into: ngram_ids' and ngram_gather_rows' glue.
inline void debug_check_ngram_values(NgramIdsParams p, const at::Tensor& query_start_loc,
                                     const at::Tensor& head_sizes, const at::Tensor& head_offsets,
                                     bool output_int32, const char* op) {
  HostIndexCopies copies;
  int64_t stride = 0;
  p.query_start_loc.data = copies.add(query_start_loc, &stride);
  p.query_start_loc.stride = stride;
  p.sizes = static_cast<const int64_t*>(copies.add(head_sizes, &stride));
  p.offsets = static_cast<const int64_t*>(copies.add(head_offsets, &stride));
  check_ngram_ids_values(p, output_int32, op);
}

}  // namespace qwen4exp
