// CPU kernel for gather_rows (SPEC §4): the entry point, run_gather_rows_cpu, and the cached
// path.
//
// A random row of a table far larger than the caches is a DRAM miss (and usually a TLB miss): the
// gather is latency-bound, not bandwidth-bound. So each worker walks its (token, head) items in
// order and, kPrefetchDistance items ahead, issues software prefetches for every cache line of the
// row it will need (row_prefetch.h): that keeps many misses in flight per core instead of one row
// at a time, which is what F.embedding / index_select do. The rows themselves are then plain
// copies (same dtype), or converted by row_convert.h's RowConverter: lookups in a table of the 256
// already-scaled, already-rounded fp8 outputs (in registers with AVX-512BW, factored into byte
// shuffles with AVX2), a vectorised decode of two E2M1 codes per byte with the row's block scales
// (NVFP4), or a vectorised decode/round loop (other conversions). All offsets are int64: the
// released table holds 51.2 billion elements.
//
// An output larger than this process's threads can keep in cache (a prefill) may take two other
// paths: the streaming one (gather_rows_stream.cpp, where the CPU has AVX) and the plain one, a
// row after another without prefetches, as index_select copies them. Which is fastest depends on
// the machine (on a Zen 4 VM streaming, 1.73x index_select; on a 2-core Xeon streaming lost to
// index_select, 0.79x, while the cached path won, 1.06x), so the first large gathers time each
// path and the rest take the fastest (choose_path, below), as ple_conv times its SiLU lookup.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "../common/gather_rows.h"
#include "gather_rows_stream.h"
#include "row_convert.h"
#include "row_prefetch.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace cpu {
namespace {

// Items per unit of work. Workers take blocks from a shared counter instead of one fixed half
// each: on a shared host a worker whose core is busy with something else simply takes fewer
// blocks, where a static split would wait for it. Up to 1024 rows (320 KiB of bf16 output) per
// block keep the counter traffic and the prefetch ramp-up at each block start negligible; a
// small (decode) batch is cut into at least two blocks per thread, down to kMinBlockItems, so it
// still spreads over the cores.
constexpr int64_t kBlockItems = 1024;
constexpr int64_t kMinBlockItems = 128;

// `bytes` from src to dst in 64-byte pieces (the last one overlapping the one before it), moved
// in the clone's vector registers: a call to memcpy per row, whose size it must first sort out,
// took 1.4x the time for rows in L2 (1024 rows of 320 bytes, Zen 4).
QWEN4EXP_ALWAYS_INLINE void copy_row_bytes(char* __restrict dst, const char* __restrict src,
                                           int64_t bytes) {
  if (bytes < 64) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  int64_t k = 0;
  for (; k + 64 <= bytes; k += 64) __builtin_memcpy(dst + k, src + k, 64);
  if (k < bytes) __builtin_memcpy(dst + bytes - 64, src + bytes - 64, 64);
}

// The cached path's same-dtype copy of one block: rows[i] (null: a zero row) to the output of
// item i, which is head h of token t counting from (t0, h0); row i + distance prefetched as row
// i is copied (distance 0: none, the plain path).
struct CopyBlock {
  const char* const* rows;
  int64_t count, row_bytes;
  char* output;
  int64_t out_token_bytes, num_heads, t0, h0, distance;
};

QWEN4EXP_CPU_CLONES void copy_block(const CopyBlock& b) {
  const char* const* const rows = b.rows;
  const int64_t count = b.count, row_bytes = b.row_bytes, nh = b.num_heads;
  const int64_t distance = b.distance;
  for (int64_t i = 0; i < std::min(count, distance); ++i) {
    if (rows[i] != nullptr) prefetch_bytes(rows[i], row_bytes);
  }
  int64_t t = b.t0, h = b.h0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t ahead = i + distance;
    if (distance > 0 && ahead < count && rows[ahead] != nullptr) {
      prefetch_bytes(rows[ahead], row_bytes);
    }
    char* dst = b.output + t * b.out_token_bytes + h * row_bytes;
    if (rows[i] != nullptr) {
      copy_row_bytes(dst, rows[i], row_bytes);
    } else {
      std::memset(dst, 0, static_cast<size_t>(row_bytes));
    }
    if (++h == nh) h = 0, ++t;
  }
}

// The cached path (distance kPrefetchDistance) or the plain one (distance 0).
template <Dtype In, Dtype Out>
void cached_gather(const GatherRowsParams& p, const RowConverter<In, Out>& convert,
                   const int64_t distance) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  // Locals, not loads through `p`: the row copies write through char-typed pointers, which may
  // alias anything, so the compiler would reload every field of `p` after each row.
  const char* const table = static_cast<const char*>(p.table);
  OutT* const output = static_cast<OutT*>(p.output);
  const int64_t nh = p.num_heads;
  const int64_t width = p.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT)) / elems_per_word(In);
  const int64_t table_row_bytes = p.table_row_stride * static_cast<int64_t>(sizeof(InT));
  constexpr bool kNvfp4 = In == Dtype::kNvfp4;
  const uint8_t* const block_scales = p.block_scales;
  const int64_t scale_row_stride = p.block_scales_row_stride;
  const int64_t scale_row_bytes = width / kNvfp4Block;
  const int64_t out_row_stride = p.output_row_stride;
  const int64_t items = p.num_tokens * nh;
  const int64_t threads = cpu::num_threads();
  const int64_t block_items =
      std::clamp<int64_t>(items / (2 * threads), kMinBlockItems, kBlockItems);
  const int64_t blocks = (items + block_items - 1) / block_items;
  const GatherRowsParams q = p;

  // One decode token is 16 rows: below a couple of blocks a second thread costs more than it
  // saves.
  cpu::parallel_blocks(blocks, 2, [&](int64_t block) {
    // Pass 1 resolves a block's ids into row addresses (nullptr: not owned, a zero row); pass 2
    // copies row i while prefetching row i + kPrefetchDistance. Keeping the id decoding and
    // bounds checks out of the copy loop leaves it as short as a plain memcpy loop, so the
    // out-of-order core runs far ahead and keeps the prefetched misses overlapping.
    const char* rows[kBlockItems];
    const uint8_t* scale_rows[kNvfp4 ? kBlockItems : 1];  // NVFP4: each row's block scales
    const int64_t begin = block * block_items;
    const int64_t count = std::min(items - begin, block_items);
    int64_t t = begin / nh, h = begin - t * nh;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = q.local_row(q.id_at(t, h));
      rows[i] = row >= 0 ? table + row * table_row_bytes : nullptr;
      if constexpr (kNvfp4) {
        scale_rows[i] = row >= 0 ? block_scales + row * scale_row_stride : nullptr;
      }
      if (++h == nh) h = 0, ++t;
    }
    t = begin / nh;
    h = begin - t * nh;
    if constexpr (In == Out) {
      copy_block({rows, count, row_bytes, reinterpret_cast<char*>(output),
                  out_row_stride * static_cast<int64_t>(sizeof(OutT)), nh, t, h, distance});
    } else {
      const auto prefetch_item = [&](int64_t i) __attribute__((always_inline)) {
        if (rows[i] == nullptr) return;
        prefetch_bytes(rows[i], row_bytes);
        if constexpr (kNvfp4)
          prefetch_bytes(reinterpret_cast<const char*>(scale_rows[i]), scale_row_bytes);
      };
      const auto write_out = [&](const char* row,
                                 const uint8_t* scales) __attribute__((always_inline)) {
        OutT* dst = output + t * out_row_stride + h * width;
        if (row != nullptr) {
          convert(reinterpret_cast<const InT*>(row), scales, dst, width);
        } else {
          std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(width) * sizeof(OutT));
        }
        if (++h == nh) h = 0, ++t;
      };
      for (int64_t i = 0; i < std::min(count, distance); ++i) prefetch_item(i);
      const auto source = [&](int64_t i) __attribute__((always_inline)) {
        return std::pair<const char*, const uint8_t*>(rows[i], kNvfp4 ? scale_rows[i] : nullptr);
      };
      convert_staged(count, row_bytes, kNvfp4 ? scale_row_bytes : 0, distance, source,
                     prefetch_item,
                     [&](int64_t, const char* staged, const uint8_t* scales)
                         __attribute__((always_inline)) { write_out(staged, scales); });
    }
  });
}

// ---- which path: pinned, by threshold, or timed ------------------------------------------------

// set_cpu_gather_path's setting (kGatherPathDefault: none pinned).
std::atomic<int64_t> path_setting{kGatherPathDefault};

// Gathers run by path, and fp8 gathers by lookup (cpu_gather_calls): one relaxed add per call.
std::atomic<int64_t> calls[kGatherCallFields];

// Each path is timed this many times, in turn, and keeps its best: the first call of a process
// also pays for what it touches first (its output's pages, the streaming path's sort buffers),
// which a second round does not.
constexpr int64_t kTimedRounds = 2;
// Timings are kept per thread count (a path that wins on one core may lose on many), up to this
// many threads; more share the last.
constexpr int64_t kTimedThreadCounts = 256;

// The timing of the large gathers of one kind (copies or conversions) at one thread count. Its
// first kTimedRounds·(paths) calls each take a slot: slot k runs path candidates[k % paths],
// timed (run_timed); the call that completes the last slot picks the fastest. Calls that find
// every slot taken but the choice not yet made take the cached path. The timed calls are real
// gathers (their outputs are the caller's), so the timing costs only what the slower paths lose
// on them, once: with the issue #51 Xeon's figures (cached 2.42 ms, streaming 3.33, plain about
// index_select's 2.64) about 1.4 ms, the streaming path's second run skipped.
struct PathTiming {
  std::atomic<int64_t> chosen{kGatherPathUntimed};
  std::atomic<int64_t> next_slot{0};
  std::mutex mutex;  // guards the rest
  int64_t done = 0;
  int64_t best_ns[kGatherPaths] = {-1, -1, -1};
  int64_t out_bytes = 0;  // the first timed call's
};

PathTiming& path_timing(bool converts, int64_t threads) {
  static PathTiming timings[2][kTimedThreadCounts];
  return timings[converts ? 1 : 0][std::clamp<int64_t>(threads, 1, kTimedThreadCounts) - 1];
}

// The paths this CPU has, in the order the timing runs them.
int64_t timed_candidates(int64_t out[kGatherPaths]) {
  int64_t n = 0;
  out[n++] = kGatherPathCached;
  if (has_streaming_path()) out[n++] = kGatherPathStream;
  out[n++] = kGatherPathPlain;
  return n;
}

// The path for a gather of out_bytes output bytes: a pinned one, else by an explicit threshold,
// else cached below cached_output_bytes(), else the timed choice (kGatherPathUntimed: not made
// yet).
int64_t choose_path(int64_t out_bytes, bool converts) {
  const int64_t pinned = path_setting.load(std::memory_order_relaxed);
  if (pinned != kGatherPathDefault) return pinned;
  const int64_t threshold = stream_bytes_setting_now();
  if (threshold >= 0) {
    return has_streaming_path() && out_bytes >= threshold ? kGatherPathStream : kGatherPathCached;
  }
  if (out_bytes < cached_output_bytes()) return kGatherPathCached;
  return path_timing(converts, num_threads()).chosen.load(std::memory_order_acquire);
}

template <Dtype In, Dtype Out>
void run_path(const GatherRowsParams& p, const RowConverter<In, Out>& convert, int64_t path) {
  calls[path].fetch_add(1, std::memory_order_relaxed);
  if (path == kGatherPathStream) return gather_rows_streaming(p, cpu_gather_stream_bytes());
  cached_gather(p, convert, path == kGatherPathPlain ? 0 : kPrefetchDistance);
}

// The fastest path timed so far (the first candidate where none is).
int64_t fastest_timed(const PathTiming& timing, const int64_t* candidates, int64_t n) {
  int64_t fastest = candidates[0];
  for (int64_t i = 1; i < n; ++i) {
    const int64_t ns = timing.best_ns[candidates[i]];
    if (ns >= 0 && (timing.best_ns[fastest] < 0 || ns < timing.best_ns[fastest])) {
      fastest = candidates[i];
    }
  }
  return fastest;
}

// A large gather before the choice is made: runs the path of the next slot, timed. Past the
// first round, a path that took more than kSkipSlowerPercent % of the fastest one's time is not
// run again (the call takes the fastest so far, untimed): it will not win, and running it again
// would only cost. The first candidate is always run again, as its first run may have paid for
// the output's first touch.
template <Dtype In, Dtype Out>
void run_timed(const GatherRowsParams& p, const RowConverter<In, Out>& convert, int64_t out_bytes,
               PathTiming& timing) {
  constexpr int64_t kSkipSlowerPercent = 125;
  int64_t candidates[kGatherPaths];
  const int64_t n = timed_candidates(candidates);
  const int64_t slot = timing.next_slot.fetch_add(1, std::memory_order_relaxed);
  if (slot >= kTimedRounds * n) return run_path(p, convert, kGatherPathCached);
  int64_t path = candidates[slot % n];
  bool timed = true;
  if (slot >= n && slot % n != 0) {
    const std::lock_guard<std::mutex> lock(timing.mutex);
    const int64_t fastest = fastest_timed(timing, candidates, n);
    const int64_t ns = timing.best_ns[path], best = timing.best_ns[fastest];
    if (ns >= 0 && best >= 0 && ns * 100 > best * kSkipSlowerPercent) path = fastest, timed = false;
  }
  const auto start = std::chrono::steady_clock::now();
  run_path(p, convert, path);
  const int64_t took =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  const std::lock_guard<std::mutex> lock(timing.mutex);
  if (timing.done == 0) timing.out_bytes = out_bytes;
  if (timed) {
    int64_t& best = timing.best_ns[path];
    best = best < 0 ? took : std::min(best, took);
  }
  if (++timing.done < kTimedRounds * n) return;
  timing.chosen.store(fastest_timed(timing, candidates, n), std::memory_order_release);
}

template <Dtype In, Dtype Out>
void gather_rows_cpu_impl(const GatherRowsParams& p) {
  using OutT = storage_t<Out>;
  const int64_t out_bytes =
      p.num_tokens * p.num_heads * p.width * static_cast<int64_t>(sizeof(OutT));
  const RowConverter<In, Out> convert(p);
  if constexpr (is_fp8(In)) {
    // The lookup this converter took: the vector ones set fp8_rows_stream (64-byte aligned
    // stores for AVX-512), else it is the scalar one.
    const int64_t lookup = convert.fp8_rows_stream == nullptr ? kFp8LookupScalar
                           : convert.fp8_stream_align == 64   ? kFp8LookupAvx512
                                                              : kFp8LookupAvx2;
    calls[kGatherPaths + lookup].fetch_add(1, std::memory_order_relaxed);
  }
  constexpr bool kConverts = In != Out;
  const int64_t path = choose_path(out_bytes, kConverts);
  if (path == kGatherPathUntimed) {
    return run_timed(p, convert, out_bytes, path_timing(kConverts, num_threads()));
  }
  run_path(p, convert, path);
}

}  // namespace
}  // namespace cpu

void run_gather_rows_cpu(const GatherRowsParams& p) {
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  cpu::dispatch_gather_dtypes(p, [&](auto in, auto out) {
    cpu::gather_rows_cpu_impl<decltype(in)::kDtype, decltype(out)::kDtype>(p);
  });
}

int64_t cpu_gather_path(int64_t out_bytes, bool converts) {
  return cpu::choose_path(out_bytes, converts);
}

int64_t set_cpu_gather_path(int64_t path) {
  if (path != kGatherPathDefault && path != kGatherPathCached && path != kGatherPathStream &&
      path != kGatherPathPlain) {
    throw std::invalid_argument(
        "set_cpu_gather_path: path must be -1 (the default), 0 (cached), 1 (stream) or 2 "
        "(plain), got " +
        std::to_string(path));
  }
  if (path == kGatherPathStream && !cpu::has_streaming_path()) {
    throw std::invalid_argument(
        "set_cpu_gather_path: the stream path needs x86-64 with AVX, which this CPU or build "
        "lacks");
  }
  return cpu::path_setting.exchange(path);
}

void cpu_gather_timing(bool converts, int64_t out[kGatherTimingFields]) {
  const int64_t threads = cpu::num_threads();
  cpu::PathTiming& timing = cpu::path_timing(converts, threads);
  const std::lock_guard<std::mutex> lock(timing.mutex);
  out[0] = timing.chosen.load(std::memory_order_acquire);
  out[1] = timing.out_bytes;
  out[2] = threads;
  std::copy(timing.best_ns, timing.best_ns + kGatherPaths, out + 3);
}

void cpu_gather_calls(bool reset, int64_t out[kGatherCallFields]) {
  for (int i = 0; i < kGatherCallFields; ++i) {
    out[i] = reset ? cpu::calls[i].exchange(0, std::memory_order_relaxed)
                   : cpu::calls[i].load(std::memory_order_relaxed);
  }
}

}  // namespace qwen4exp