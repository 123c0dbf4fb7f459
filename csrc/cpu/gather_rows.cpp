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
// An output larger than this process's threads can keep in cache (a prefill) takes the
// streaming path instead, where the CPU has AVX: gather_rows_stream.cpp.
#include <algorithm>
#include <cstring>
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
// item i, which is head h of token t counting from (t0, h0); row i + kPrefetchDistance
// prefetched as row i is copied.
struct CopyBlock {
  const char* const* rows;
  int64_t count, row_bytes;
  char* output;
  int64_t out_token_bytes, num_heads, t0, h0;
};

QWEN4EXP_CPU_CLONES void copy_block(const CopyBlock& b) {
  const char* const* const rows = b.rows;
  const int64_t count = b.count, row_bytes = b.row_bytes, nh = b.num_heads;
  for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) {
    if (rows[i] != nullptr) prefetch_bytes(rows[i], row_bytes);
  }
  int64_t t = b.t0, h = b.h0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t ahead = i + kPrefetchDistance;
    if (ahead < count && rows[ahead] != nullptr) prefetch_bytes(rows[ahead], row_bytes);
    char* dst = b.output + t * b.out_token_bytes + h * row_bytes;
    if (rows[i] != nullptr) {
      copy_row_bytes(dst, rows[i], row_bytes);
    } else {
      std::memset(dst, 0, static_cast<size_t>(row_bytes));
    }
    if (++h == nh) h = 0, ++t;
  }
}

// The streaming path for an output of at least cpu_gather_stream_bytes() bytes, else the cached
// path.
template <Dtype In, Dtype Out>
void gather_rows_cpu_impl(const GatherRowsParams& p) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const int64_t out_bytes =
      p.num_tokens * p.num_heads * p.width * static_cast<int64_t>(sizeof(OutT));
  const int64_t stream_bytes_from = cpu_gather_stream_bytes();
  if (stream_bytes_from >= 0 && out_bytes >= stream_bytes_from) {
    return gather_rows_streaming(p, stream_bytes_from);
  }
  const RowConverter<In, Out> convert(p);
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
                  out_row_stride * static_cast<int64_t>(sizeof(OutT)), nh, t, h});
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
      for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) prefetch_item(i);
      const auto source = [&](int64_t i) __attribute__((always_inline)) {
        return std::pair<const char*, const uint8_t*>(rows[i], kNvfp4 ? scale_rows[i] : nullptr);
      };
      convert_staged(count, row_bytes, kNvfp4 ? scale_row_bytes : 0, source, prefetch_item,
                     [&](int64_t, const char* staged, const uint8_t* scales)
                         __attribute__((always_inline)) { write_out(staged, scales); });
    }
  });
}

}  // namespace
}  // namespace cpu

void run_gather_rows_cpu(const GatherRowsParams& p) {
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  cpu::dispatch_gather_dtypes(p, [&](auto in, auto out) {
    cpu::gather_rows_cpu_impl<decltype(in)::kDtype, decltype(out)::kDtype>(p);
  });
}

}  // namespace qwen4exp