// CPU kernel for gather_rows (SPEC.md §4).
//
// A random row of a table far larger than the caches is a DRAM miss (and usually a TLB miss): the
// gather is latency-bound, not bandwidth-bound. So each worker walks its (token, head) items in
// order and, kPrefetchDistance items ahead, issues software prefetches for every cache line of the
// row it will need: that keeps many misses in flight per core instead of one row at a time, which
// is what F.embedding / index_select do. The rows themselves are then plain copies (same dtype),
// one table lookup per byte (fp8: a 256-entry table of already-scaled, already-rounded outputs),
// or a decode/round loop (other conversions). All offsets are int64: the released table holds
// 51.2 billion elements.
#include <ATen/Parallel.h>
#include <torch/all.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>

#include "../gather_rows_args.h"

namespace qwen4exp {
namespace {

// Items (rows) looked ahead. One row of the released table is 320 bytes (bf16) = 5 lines, so 16
// rows keep ~80 line fills outstanding per core: enough to cover DRAM + page-walk latency while
// staying well inside L1/L2 (what is prefetched is consumed a few hundred ns later).
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

// always_inline is load-bearing: GCC's IPA treats __builtin_prefetch as free of side effects,
// so a helper that only prefetches is classified "const" and every call to it is deleted as dead
// code (GCC 12 -O3 drops them all). Inlined, the prefetches stay in the loop.
// Locality 2 (prefetcht1: into L2 and below) rather than 0 (prefetchnta): on the 2-core Zen 4
// CI host, T = 8192 x 16 bf16 rows from a 4M-row table took 3.4 ms instead of 4.0 ms on a
// huge-page table and ~5.1 ms either way on 4 KiB pages (medians of 21, same run); distances
// 8-32 were within noise of 16.
__attribute__((always_inline)) inline void prefetch_bytes(const char* begin, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(kCacheLine - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(begin + bytes - 1);
  for (uintptr_t line = first; line <= last; line += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

template <GatherDtype In, GatherDtype Out>
struct RowConverter {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  std::array<OutT, 256> lut{};  // fp8 only

  explicit RowConverter(const GatherRowsParams& p) {
    if constexpr (is_fp8(In)) {
      // Every fp8 byte has one possible output: build all 256 once per call.
      const float scale_out = round_scale<Out>(*p.scale);
      for (int b = 0; b < 256; ++b) lut[b] = dequantize<In, Out>(static_cast<uint8_t>(b), scale_out);
    }
  }

  void operator()(const InT* __restrict src, OutT* __restrict dst, int64_t width) const {
    if constexpr (In == Out) {
      std::memcpy(dst, src, static_cast<size_t>(width) * sizeof(InT));
    } else if constexpr (is_fp8(In)) {
      for (int64_t i = 0; i < width; ++i) dst[i] = lut[src[i]];
    } else {
      for (int64_t i = 0; i < width; ++i) dst[i] = encode<Out>(decode<In>(src[i]));
    }
  }
};

// Items per unit of work. Workers take blocks from a shared counter instead of one fixed half
// each: on a shared host a worker whose core is busy with something else simply takes fewer
// blocks, where a static split would wait for it. Up to 1024 rows (320 KiB of bf16 output) per
// block keep the counter traffic and the prefetch ramp-up at each block start negligible; a
// small (decode) batch is cut into at least two blocks per thread, down to kMinBlockItems, so it
// still spreads over the cores.
constexpr int64_t kBlockItems = 1024;
constexpr int64_t kMinBlockItems = 128;

template <GatherDtype In, GatherDtype Out>
void gather_rows_cpu_impl(const GatherRowsParams& p) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const RowConverter<In, Out> convert(p);
  // Locals, not loads through `p`: the row copies write through char-typed pointers, which may
  // alias anything, so the compiler would reload every field of `p` after each row.
  const char* const table = static_cast<const char*>(p.table);
  OutT* const output = static_cast<OutT*>(p.output);
  const int64_t nh = p.num_heads;
  const int64_t width = p.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT));
  const int64_t table_row_bytes = p.table_row_stride * static_cast<int64_t>(sizeof(InT));
  const int64_t out_row_stride = p.output_row_stride;
  const int64_t items = p.num_tokens * nh;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t block_items =
      std::clamp<int64_t>(items / (2 * threads), kMinBlockItems, kBlockItems);
  const int64_t blocks = (items + block_items - 1) / block_items;
  const GatherRowsParams q = p;

  std::atomic<int64_t> next_block{0};
  // One decode token is 16 rows: below a couple of blocks a second thread costs more than it
  // saves.
  at::parallel_for(0, blocks, 2, [&](int64_t, int64_t) {
    // Pass 1 resolves a block's ids into row addresses (nullptr: not owned, a zero row); pass 2
    // copies row i while prefetching row i + kPrefetchDistance. Keeping the id decoding and
    // bounds checks out of the copy loop leaves it as short as a plain memcpy loop, so the
    // out-of-order core runs far ahead and keeps the prefetched misses overlapping.
    const char* rows[kBlockItems];
    for (int64_t block = next_block.fetch_add(1, std::memory_order_relaxed); block < blocks;
         block = next_block.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t begin = block * block_items;
      const int64_t count = std::min(items - begin, block_items);
      int64_t t = begin / nh, h = begin - t * nh;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t row = q.local_row(q.id_at(t, h));
        rows[i] = row >= 0 ? table + row * table_row_bytes : nullptr;
        if (++h == nh) h = 0, ++t;
      }
      for (int64_t i = 0; i < std::min(count, kPrefetchDistance); ++i) {
        if (rows[i] != nullptr) prefetch_bytes(rows[i], row_bytes);
      }
      t = begin / nh;
      h = begin - t * nh;
      for (int64_t i = 0; i < count; ++i) {
        if (i + kPrefetchDistance < count && rows[i + kPrefetchDistance] != nullptr) {
          prefetch_bytes(rows[i + kPrefetchDistance], row_bytes);
        }
        OutT* dst = output + t * out_row_stride + h * width;
        if (rows[i] != nullptr) {
          convert(reinterpret_cast<const InT*>(rows[i]), dst, width);
        } else {
          std::memset(static_cast<void*>(dst), 0, static_cast<size_t>(width) * sizeof(OutT));
        }
        if (++h == nh) h = 0, ++t;
      }
    }
  });
}

template <GatherDtype In>
void dispatch_out(const GatherRowsParams& p) {
  switch (p.out_dtype) {
    case GatherDtype::kF32: return gather_rows_cpu_impl<In, GatherDtype::kF32>(p);
    case GatherDtype::kBF16: return gather_rows_cpu_impl<In, GatherDtype::kBF16>(p);
    case GatherDtype::kF16: return gather_rows_cpu_impl<In, GatherDtype::kF16>(p);
    default: TORCH_CHECK(false, "gather_rows: unsupported output dtype");
  }
}

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& ids,
                     const std::optional<at::Tensor>& scale, int64_t vocab_start,
                     int64_t vocab_end, const at::Tensor& output) {
  const GatherRowsParams p =
      check_gather_rows_args(table, ids, scale, vocab_start, vocab_end, output);
  TORCH_CHECK(table.device().is_cpu(), "gather_rows: CPU kernel called with ", table.device(),
              " tensors");
  if (p.num_tokens == 0 || p.num_heads == 0 || p.width == 0) return;
  switch (p.table_dtype) {
    case GatherDtype::kF32: return dispatch_out<GatherDtype::kF32>(p);
    case GatherDtype::kBF16: return dispatch_out<GatherDtype::kBF16>(p);
    case GatherDtype::kF16: return dispatch_out<GatherDtype::kF16>(p);
    case GatherDtype::kFp8E4M3FN: return dispatch_out<GatherDtype::kFp8E4M3FN>(p);
    case GatherDtype::kFp8E4M3FNUZ: return dispatch_out<GatherDtype::kFp8E4M3FNUZ>(p);
  }
}

}  // namespace
}  // namespace qwen4exp

TORCH_LIBRARY_IMPL(qwen4exp, CPU, m) {
  m.impl("gather_rows", &qwen4exp::gather_rows_cpu);
}
