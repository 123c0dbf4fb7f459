// Rows fetched ahead, for the CPU gathers (gather_rows.cpp's cached path and
// gather_rows_stream.cpp's streaming path): software prefetches of a row's cache lines, issued
// kPrefetchDistance rows ahead of the copy, and convert_staged, the loop that keeps them ahead
// when rows are converted rather than copied. Header-only: everything here is inlined into the
// paths' loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace qwen4exp::cpu {

// Items (rows) looked ahead. One row of the released table is 320 bytes (bf16) = 5 lines, so 16
// rows keep ~80 line fills outstanding per core: enough to cover DRAM + page-walk latency while
// staying well inside L1/L2 (what is prefetched is consumed a few hundred ns later). A prefetch
// that misses the TLB holds retirement until its page walk ends, so the reorder buffer, not the
// distance, bounds the walks in flight: sorting by address (the streaming path) is what makes
// walks cheaper (docs/design/cpu-kernel-notes.md).
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

// always_inline is load-bearing: GCC's IPA treats __builtin_prefetch as free of side effects,
// so a helper that only prefetches is classified "const" and every call to it is deleted as dead
// code (GCC 12 -O3 drops them all). Inlined, the prefetches stay in the loop.
// Locality 3 (prefetcht0: into L1 and below), as the row is copied a few hundred ns later:
// faster than prefetcht1 and prefetchnta on every id pattern measured
// (docs/design/cpu-kernel-notes.md).
__attribute__((always_inline)) inline void prefetch_bytes(const char* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(begin + bytes - 1);
  for (uintptr_t line = first; line <= last; line += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
  }
}

// A converting gather copies its rows as stored, this many bytes of them at a time, before
// converting them (convert_staged): with the streaming path's conversion stage (2 KiB), well
// inside a 32 KiB L1.
constexpr int64_t kRawStageBytes = 16384;

// convert_staged's buffer: this thread's chunk of rows as they are stored, kept across calls.
inline std::vector<char>& raw_stage() {
  thread_local std::vector<char> raw;
  return raw;
}

// The converting gathers of both paths. A converted row costs several times the instructions of
// a copied one, and while a prefetch waits for its page walk the reorder buffer then holds fewer
// rows, so fewer misses overlap (fp8 rows, half the bytes, took 1.5x the time of bf16 ones). So
// items [0, count) go in chunks of kRawStageBytes: a chunk's rows are first copied as they are
// stored (each followed by its NVFP4 block scales, scale_bytes of them) into this thread's
// L1-resident buffer, in a loop as lean as the same-dtype copy, prefetching
// prefetch(j + distance) as it goes (distance 0: none, the plain path; the caller prefetches the
// first `distance` items); then emit(j, row, scales) converts each from there. source(j) gives
// item j's row and scales as stored; a null row is a zero row, which is not staged and reaches
// emit as a null row.
template <typename Source, typename Prefetch, typename Emit>
__attribute__((always_inline)) inline void convert_staged(int64_t count, int64_t row_bytes,
                                                          int64_t scale_bytes, int64_t distance,
                                                          Source source, Prefetch prefetch,
                                                          Emit emit) {
  const int64_t raw_bytes = row_bytes + scale_bytes;
  const int64_t chunk_rows = std::max<int64_t>(1, kRawStageBytes / raw_bytes);
  std::vector<char>& raw = raw_stage();
  raw.resize(static_cast<size_t>(chunk_rows * raw_bytes));
  for (int64_t j0 = 0; j0 < count; j0 += chunk_rows) {
    const int64_t end = std::min(count, j0 + chunk_rows);
    for (int64_t j = j0; j < end; ++j) {
      if (distance > 0 && j + distance < count) prefetch(j + distance);
      const auto [row, scales] = source(j);
      if (row == nullptr) continue;
      char* staged = raw.data() + (j - j0) * raw_bytes;
      std::memcpy(staged, row, static_cast<size_t>(row_bytes));
      if (scale_bytes > 0)
        std::memcpy(staged + row_bytes, scales, static_cast<size_t>(scale_bytes));
    }
    for (int64_t j = j0; j < end; ++j) {
      const char* staged = raw.data() + (j - j0) * raw_bytes;
      const bool zero = source(j).first == nullptr;
      emit(j, zero ? nullptr : staged,
           reinterpret_cast<const uint8_t*>(zero ? nullptr : staged + row_bytes));
    }
  }
}

}  // namespace qwen4exp::cpu
