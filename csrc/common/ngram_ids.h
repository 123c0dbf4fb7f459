// ngram_ids (SPEC §3): the entry points of the CPU kernel (csrc/cpu/ngram_ids.cpp) and of the
// HIP kernel's launcher (csrc/hip/ngram_ids.hip). The params and the hash they share are in
// ngram_hash.h. Torch-free.
#pragma once

#include "ngram_hash.h"
#include "platform.h"

namespace qwen4exp {

// The CPU kernel, on the calling thread and the CPU kernels' threads (csrc/cpu/threads.h);
// returns when done. Expects what launch_ngram_ids expects (T may be 0), in host memory, and the
// values the torch glue checks for (check_ngram_ids_values: a valid query_start_loc, positive
// head sizes, offsets that do not overflow the output type).
QWEN4EXP_API void run_ngram_ids_cpu(const NgramIdsParams& p, bool output_int64);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the kernel on `stream`. Returns the launch status (hipSuccess or the error); the glue
// turns a failure into a Python exception. Expects p.num_requests >= 0 and p.num_tokens > 0.
hipError_t launch_ngram_ids(const NgramIdsParams& p, bool output_int64, hipStream_t stream);
#endif

}  // namespace qwen4exp
