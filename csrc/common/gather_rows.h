// gather_rows (SPEC §4): the params struct shared by the CPU kernel, the HIP kernel and the
// host glue, and the launcher of the HIP kernel. Torch-free.
#pragma once

#include "fp8.h"
#include "platform.h"

namespace qwen4exp {

struct GatherRowsParams {
  // Table [rows, d]: row r starts at storage word r·table_row_stride (rows are contiguous). On the
  // GPU this may be the device address of pinned host memory (zero-copy over PCIe). An NVFP4
  // table is bytes [rows, d/2], two elements per byte.
  const void* table;
  int64_t table_row_stride;  // storage words (bytes for fp8 and NVFP4)
  int64_t rows;
  int64_t width;  // d, in elements
  // Ids [T, NH], int32 or int64, any strides (elements).
  const void* ids;
  int64_t ids_row_stride;
  int64_t ids_col_stride;
  bool ids_int64;
  // Output [T, NH·d]; head h of token t at element t·output_row_stride + h·d.
  void* output;
  int64_t output_row_stride;
  // fp8 and NVFP4 tables: the per-tensor (NVFP4: global) fp32 scale, one element on the kernel's
  // device.
  const float* scale;
  // NVFP4 tables only: float8_e4m3fn [rows, d/16], the scale of elements [16j, 16j+16) of row r at
  // byte r·block_scales_row_stride + j (same device as the table: pinned host memory too).
  const uint8_t* block_scales;
  int64_t block_scales_row_stride;  // bytes
  int64_t num_tokens;               // T
  int64_t num_heads;                // NH
  // Global ids in [vocab_start, vocab_end) read table[id - vocab_start]; 0 <= vocab_start <=
  // vocab_end and vocab_end - vocab_start <= rows. Every other id gives a zero row.
  int64_t vocab_start;
  int64_t vocab_end;
  Dtype table_dtype;
  Dtype out_dtype;
  // GPU launches only (the CPU kernel ignores it): the most blocks any one launch of the gather
  // may use, or 0 for no cap (the launcher's own grid, enough blocks to cover the work once).
  // Every kernel of the gather strides over its grid, so any cap gives the same output: it bounds
  // the share of the GPU that a gather on a side stream takes from the compute running beside it.
  // Last, so that an initialiser written before it leaves it 0.
  int64_t max_blocks;

  QWEN4EXP_HD int64_t id_at(int64_t t, int64_t h) const {
    const int64_t offset = t * ids_row_stride + h * ids_col_stride;
    return ids_int64 ? static_cast<const int64_t*>(ids)[offset]
                     : static_cast<int64_t>(static_cast<const int32_t*>(ids)[offset]);
  }

  // The local table row of a global id, or -1 when this table does not own it. The comparison
  // comes before the subtraction, so no id value (INT64_MIN included) can overflow into range.
  QWEN4EXP_HD int64_t local_row(int64_t id) const {
    return (id >= vocab_start && id < vocab_end) ? id - vocab_start : int64_t{-1};
  }
};

// The CPU kernel (csrc/cpu/gather_rows.cpp): gathers on the calling thread and the CPU kernels'
// threads (csrc/cpu/threads.h) and returns when done. Expects what launch_gather_rows expects,
// with every pointer in host memory. Throws std::invalid_argument on a dtype pair it has no
// kernel for.
QWEN4EXP_API void run_gather_rows_cpu(const GatherRowsParams& p);

// The CPU kernel's paths (csrc/cpu/gather_rows.cpp): kGatherPathCached (prefetched rows,
// ordinary stores), kGatherPathStream (sorted reads, non-temporal stores; x86-64 with AVX) and
// kGatherPathPlain (one row after another, no prefetch: what index_select does).
constexpr int64_t kGatherPathDefault = -1;  // set_cpu_gather_path: no pinned path
constexpr int64_t kGatherPathCached = 0;
constexpr int64_t kGatherPathStream = 1;
constexpr int64_t kGatherPathPlain = 2;
constexpr int64_t kGatherPathUntimed = 3;  // cpu_gather_path: large gathers not timed yet
constexpr int64_t kGatherPaths = 3;

// Which path a gather takes. An output smaller than what this process's threads can keep in
// cache takes the cached path. A larger one takes the path timed on this machine: the first
// 2·(paths) large gathers of a kind (same-dtype copies, or conversions) at a thread count run
// each path in turn and time it, and every later one takes the fastest. An explicit setting
// wins over that timing: set_cpu_gather_path pins one path for every size;
// set_cpu_gather_stream_bytes a threshold (streaming from it on, cached below it).

// The CPU kernel streams outputs of at least this many bytes by an explicit threshold, and times
// its paths for outputs of at least this many bytes by default (what this process's threads can
// keep in cache); -1 where this CPU or build has no streaming path.
QWEN4EXP_API int64_t cpu_gather_stream_bytes();
// Sets that threshold (bytes >= 0, or -1: no threshold, the timed default) and returns the
// setting it replaces.
QWEN4EXP_API int64_t set_cpu_gather_stream_bytes(int64_t bytes);
// The path a gather of `out_bytes` output bytes (of a conversion, with `converts`) would take now
// on the calling thread's thread count; kGatherPathUntimed where it would time one.
QWEN4EXP_API int64_t cpu_gather_path(int64_t out_bytes, bool converts);
// Pins a path (kGatherPathDefault: none) and returns the setting it replaces; throws
// std::invalid_argument on an unknown path or the streaming path where this CPU has none.
QWEN4EXP_API int64_t set_cpu_gather_path(int64_t path);
// The timing of the large gathers of a kind at the calling thread count: {chosen path (or
// kGatherPathUntimed), output bytes of the first timed call, threads, then the best time in ns
// of each path (cached, stream, plain; -1: not timed)}.
constexpr int kGatherTimingFields = 3 + kGatherPaths;
QWEN4EXP_API void cpu_gather_timing(bool converts, int64_t out[kGatherTimingFields]);
// Gathers run since the last reset, by path (cached, stream, plain), then fp8 gathers by the
// lookup they converted with (scalar, AVX2, AVX-512): what the bench reports as the path that
// ran. With `reset` the counts start again from zero.
constexpr int kGatherCallFields = kGatherPaths + 3;
QWEN4EXP_API void cpu_gather_calls(bool reset, int64_t out[kGatherCallFields]);

// How the CPU kernel converts fp8 rows: kFp8LookupScalar (a 256-entry table, an element at a
// time), kFp8LookupAvx2 (byte shuffles, for 16-bit outputs whose table factors; scalar
// otherwise) or kFp8LookupAvx512 (AVX-512BW permutes). By default the widest this CPU has;
// set_cpu_gather_fp8_lookup pins one (kFp8LookupBest: the default again), so that a test can run
// every one this CPU has. It throws std::invalid_argument on an unknown value, and on a lookup
// this CPU or build lacks.
constexpr int64_t kFp8LookupBest = -1;
constexpr int64_t kFp8LookupScalar = 0;
constexpr int64_t kFp8LookupAvx2 = 1;
constexpr int64_t kFp8LookupAvx512 = 2;
QWEN4EXP_API int64_t cpu_gather_fp8_lookup();
QWEN4EXP_API int64_t set_cpu_gather_fp8_lookup(int64_t lookup);

#if defined(QWEN4EXP_HAS_LAUNCHERS)  // a CPU-only build sees only the params
// Enqueues the gather on `stream`; returns the launch status. Expects T·NH·d > 0.
hipError_t launch_gather_rows(const GatherRowsParams& p, hipStream_t stream);
#endif

}  // namespace qwen4exp
