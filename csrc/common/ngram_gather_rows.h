// ngram_gather_rows: ngram_ids (SPEC §3) and gather_rows (SPEC §4) as one op, the ids never
// written to a tensor. The entry points of the CPU kernel (csrc/cpu/ngram_gather_rows.cpp) and of
// the fused HIP kernel's launcher (csrc/hip/gather_rows.hip). Torch-free.
#pragma once

#include "gather_rows.h"
#include "ngram_hash.h"

namespace qwen4exp {

// The ids of gather are those ngram computes; ngram.output and gather's ids fields are unused.
// ngram.num_tokens == gather.num_tokens and ngram.num_heads == gather.num_heads. The grid cap of
// every launch is gather.max_blocks (ngram.max_blocks is unused too).
struct NgramGatherRowsParams {
  NgramIdsParams ngram;
  GatherRowsParams gather;
};

// The two ops' params to run them through an ids buffer (int64 [T, NH], rows contiguous): what
// the CPU kernel does, and the GPU glue where the fused kernel does not apply.
struct ThroughIds {
  NgramIdsParams hash;
  GatherRowsParams gather;
};
inline ThroughIds through_ids(const NgramGatherRowsParams& p, int64_t* ids) {
  ThroughIds two{p.ngram, p.gather};
  two.hash.output = ids;
  two.hash.output_row_stride = p.gather.num_heads;
  two.hash.output_col_stride = 1;
  two.gather.ids = ids;
  two.gather.ids_row_stride = p.gather.num_heads;
  two.gather.ids_col_stride = 1;
  two.gather.ids_int64 = true;
  // The op's grid cap bounds both of its launches. The ids kernel runs on the same (side) stream
  // as the gather: left uncapped, a prefill's ids (T·NH/256 blocks, up to 2^16) would fill every
  // compute unit while it runs, the very starvation the cap is there to prevent. It strides over
  // its grid like the gather's kernels, so the ids are the same under any cap.
  two.hash.max_blocks = p.gather.max_blocks;
  return two;
}

// The CPU kernel: the ids of the batch into a per-thread buffer (ngram_ids' CPU kernel), then the
// gather from it; returns when done. Expects what run_ngram_ids_cpu and run_gather_rows_cpu
// expect.
QWEN4EXP_API void run_ngram_gather_rows_cpu(const NgramGatherRowsParams& p);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the fused kernel on `stream` where it applies (the released N = 3, a table other than
// NVFP4, its rows and the output in 16-byte pieces, every piece in one launch) and sets *launched;
// else launches nothing and sets *launched to false, and the caller runs launch_ngram_ids and
// launch_gather_rows through an ids buffer. Returns the launch status. Expects T·NH·d > 0.
hipError_t launch_ngram_gather_rows(const NgramGatherRowsParams& p, hipStream_t stream,
                                    bool* launched);
#endif

}  // namespace qwen4exp
