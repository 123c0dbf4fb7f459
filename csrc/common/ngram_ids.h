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

// How the CPU kernel reduces each head's mix: kNgramHashScalar (a head at a time), kNgramHashAvx2
// (4 heads a step) or kNgramHashAvx512 (8, AVX-512F and DQ); csrc/cpu/ngram_hash_simd.cpp. The same
// ids in every width. By default the widest this CPU has; set_cpu_ngram_hash_isa pins one
// (kNgramHashBest: the default again), so that a test can run every one this CPU has, and
// returns the setting it replaces. It throws std::invalid_argument on an unknown value, and on a
// width this CPU or build lacks. The fused ngram_gather_rows hashes with the same setting.
constexpr int64_t kNgramHashBest = -1;
constexpr int64_t kNgramHashScalar = 0;
constexpr int64_t kNgramHashAvx2 = 1;
constexpr int64_t kNgramHashAvx512 = 2;
QWEN4EXP_API int64_t cpu_ngram_hash_isa();
QWEN4EXP_API int64_t set_cpu_ngram_hash_isa(int64_t isa);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the kernel on `stream`. Returns the launch status (hipSuccess or the error); the glue
// turns a failure into a Python exception. Expects p.num_requests >= 0 and p.num_tokens > 0.
hipError_t launch_ngram_ids(const NgramIdsParams& p, bool output_int64, hipStream_t stream);
#endif

}  // namespace qwen4exp
