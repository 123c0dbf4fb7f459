// Launcher of the HIP n-gram id kernel: the torch-free boundary between the device code in
// ngram_ids.hip and the host glue in csrc/gpu/ngram_ids_gpu.cpp.
#pragma once

#include "ngram_hash.h"
#include "platform.h"

namespace qwen4exp {

// Enqueues the kernel on `stream`. Returns the launch status (hipSuccess or the error); the glue
// turns a failure into a Python exception. Expects p.num_requests >= 0 and p.num_tokens > 0.
hipError_t launch_ngram_ids(const NgramIdsParams& p, bool output_int64, hipStream_t stream);

}  // namespace qwen4exp
