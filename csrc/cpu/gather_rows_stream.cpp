// The streaming path of the CPU gather_rows (SPEC §4), and its switch, set_cpu_gather_stream_bytes.
//
// An output larger than what this process's threads can keep in cache (a prefill) would have
// its lines read from DRAM before being overwritten (read-for-ownership) and evicted again before
// anyone reads them: streaming (non-temporal) stores write whole lines straight to memory
// instead, a third less DRAM traffic; 64-byte stores with AVX-512, 32-byte ones with AVX
// (x86-64 CPUs without AVX, and other architectures, keep the cached path).
// Each block of items is also counting-sorted by table row first and copied in table order: the
// row reads sweep the table upwards, consecutive rows share page-table lines and DRAM pages, and
// the page walk that every random row of a multi-GB table costs gets cheaper. That pays with
// either store width: on a Zen 3 EPYC (AVX2, 32-byte stores) the sorted copy took 0.84-0.91x
// the time of the copy in output order, side by side (docs/design/cpu-kernel-notes.md).

#include "gather_rows_stream.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/dispatch.h"
#include "cache_size.h"
#include "row_convert.h"
#include "row_prefetch.h"
#include "simd.h"
#include "threads.h"

namespace qwen4exp {
namespace cpu {
namespace {

// Items per block: the more a block holds, the denser its sorted rows lie in the table (32768
// rows spread over a 4M-row table put one every ~40 KiB, 65536 one every ~20 KiB) and the more
// page-table lines each walk shares with the next. The sort's scratch (kStreamScratchBytes an
// item) should stay in the core's L2, which bounds a block; one block per thread, down to 1024
// items, so that a many-core host still puts every core to work. (On a 2-core Zen 5 VM, 1 MiB
// L2: 65536-item blocks 1.61x index_select at T = 8192, 32768-item ones 1.36x, 131072 1.39x.)
constexpr int64_t kStreamScratchBytes = sizeof(int64_t) + 2 * sizeof(int32_t);
constexpr int64_t kStreamMinBlockItems = 1024;
// Conversions are staged through an L1-resident buffer of this many bytes, then written out.
constexpr int64_t kStageBytes = 2048;

// How the streaming path writes rows: streaming stores 32 or 64 bytes wide (plain ones where the
// CPU has neither).
enum class RowStores { kPlain, kStream32, kStream64 };

// n bytes at dst from src, or zeros with kZeros (src then unused, may be null).
template <bool kZeros>
__attribute__((always_inline)) inline void plain_bytes(char* dst, const char* src, int64_t n) {
  if (n <= 0) return;
  if constexpr (kZeros) {
    std::memset(dst, 0, static_cast<size_t>(n));
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n));
  }
}

#if QWEN4EXP_X86_AVX512  // x86-64: the streaming stores, each compiled for its instruction set

// Writing `bytes` at `dst` with kWide-byte streaming stores: whole aligned pieces [head, end)
// streamed, the unaligned head [0, head) and tail [end, bytes) (if any) written with ordinary
// stores.
template <int kWide>
struct StreamSplit {
  int64_t head, end;
  StreamSplit(const char* dst, int64_t bytes) {
    head = std::min<int64_t>(bytes,
                             static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & (kWide - 1)));
    end = head + (bytes - head) / kWide * kWide;
  }
};

// `bytes` at `dst`, copied from `src` (or zeros, with kZeros; `src` is then unused, may be
// null), `src` unaligned or not. One row per call, not inlined into the copy loop (whose
// instruction set is the baseline's): a call costs a few ns against the tens of a cold
// 320-byte row.
template <bool kZeros>
__attribute__((target("avx512f"))) void stream_row64(char* dst, const char* src, int64_t bytes) {
  const StreamSplit<64> split(dst, bytes);
  plain_bytes<kZeros>(dst, src, split.head);
  for (int64_t i = split.head; i < split.end; i += 64) {
    const __m512i v = kZeros ? _mm512_setzero_si512() : _mm512_loadu_si512(src + i);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), v);
  }
  plain_bytes<kZeros>(dst + split.end, kZeros ? nullptr : src + split.end, bytes - split.end);
}

template <bool kZeros>
__attribute__((target("avx"))) void stream_row32(char* dst, const char* src, int64_t bytes) {
  const StreamSplit<32> split(dst, bytes);
  plain_bytes<kZeros>(dst, src, split.head);
  for (int64_t i = split.head; i < split.end; i += 32) {
    const __m256i v = kZeros ? _mm256_setzero_si256()
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
  }
  plain_bytes<kZeros>(dst + split.end, kZeros ? nullptr : src + split.end, bytes - split.end);
}
#endif  // QWEN4EXP_X86_AVX512

// The widest streaming stores this CPU has.
RowStores best_row_stores() {
#if QWEN4EXP_X86_AVX512
  if (simd::cpu_has_avx512f()) return RowStores::kStream64;
  if (simd::cpu_has_avx()) return RowStores::kStream32;
#endif
  return RowStores::kPlain;
}

// `bytes` at `dst` from `src`, or zeros with kZeros.
template <bool kZeros>
__attribute__((always_inline)) inline void write_row(RowStores stores, char* dst, const char* src,
                                                     int64_t bytes) {
#if QWEN4EXP_X86_AVX512
  if (stores == RowStores::kStream64) return stream_row64<kZeros>(dst, src, bytes);
  if (stores == RowStores::kStream32) return stream_row32<kZeros>(dst, src, bytes);
#endif
  plain_bytes<kZeros>(dst, src, bytes);
}

// A worker's sort buffers, kept across calls (no page faults on 0.5 MiB per block).
struct StreamScratch {
  std::vector<int64_t> row_of;       // [block] table row of each item, -1: a zero row
  std::vector<int32_t> order;        // [block] the owned items, by table row bucket
  std::vector<int32_t> bucket_next;  // [buckets + 1] counting-sort offsets
};

StreamScratch& stream_scratch() {
  thread_local StreamScratch scratch;
  return scratch;
}

template <Dtype In, Dtype Out>
struct StreamJob {
  GatherRowsParams p;
  const RowConverter<In, Out>* convert;
  RowStores stores;
  int64_t items, block_items, blocks, shift, buckets;
  int64_t cache_bytes;  // what one thread can keep in cache (cpu_gather_stream_bytes / threads)
};

// One block of items.
template <Dtype In, Dtype Out>
void stream_block(const StreamJob<In, Out>& job, int64_t block) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  const GatherRowsParams& q = job.p;
  const RowStores stores = job.stores;
  const char* const table = static_cast<const char*>(q.table);
  char* const output = static_cast<char*>(q.output);
  const int64_t nh = q.num_heads;
  const int64_t width = q.width;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(InT)) / elems_per_word(In);
  const int64_t out_row_bytes = width * static_cast<int64_t>(sizeof(OutT));
  const int64_t table_row_bytes = q.table_row_stride * static_cast<int64_t>(sizeof(InT));
  const int64_t out_token_bytes = q.output_row_stride * static_cast<int64_t>(sizeof(OutT));
  const bool dense_output = q.output_row_stride == nh * width;
  const int shift = static_cast<int>(job.shift);
  StreamScratch& s = stream_scratch();
  s.row_of.resize(static_cast<size_t>(job.block_items));
  s.order.resize(static_cast<size_t>(job.block_items));
  s.bucket_next.resize(static_cast<size_t>(job.buckets + 1));
  int64_t* const row_of = s.row_of.data();
  int32_t* const order = s.order.data();
  int32_t* const bucket_next = s.bucket_next.data();

  auto item_output = [&](int64_t item) __attribute__((always_inline)) {
    if (dense_output) return output + item * out_row_bytes;
    const int64_t t = item / nh;
    return output + t * out_token_bytes + (item - t * nh) * out_row_bytes;
  };
  const int64_t begin = block * job.block_items;
  const int64_t count = std::min(job.items - begin, job.block_items);
  // Resolve ids and write the zero rows now. The owned rows are counted per bucket of table rows,
  // then counting-sorted into table order (or listed in output order, below).
  std::fill(bucket_next, bucket_next + job.buckets + 1, 0);
  int64_t owned = 0, filled_buckets = 0;
  int64_t t = begin / nh, h = begin - t * nh;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = q.local_row(q.id_at(t, h));
    row_of[i] = row;
    if (row < 0) {
      write_row<true>(stores, output + t * out_token_bytes + h * out_row_bytes, nullptr,
                      out_row_bytes);
    } else {
      filled_buckets += bucket_next[(row >> shift) + 1]++ == 0;
    }
    if (++h == nh) h = 0, ++t;
  }
  // Rows that repeat so much that the block's distinct ones (at most one per filled bucket,
  // as buckets are about as many as items) fit in what this thread can keep in cache (its
  // share of the streaming threshold) need no page walk after their first use: sorting them would
  // only scatter the output's stores over its pages (1024 distinct rows, sorted: 0.70x
  // index_select; in output order: 1.14x). They are copied in output order.
  const bool sort = filled_buckets * row_bytes > job.cache_bytes;
  if (!sort) {
    for (int64_t i = 0; i < count; ++i) {
      if (row_of[i] >= 0) order[owned++] = static_cast<int32_t>(i);
    }
  } else {
    for (int64_t b = 0; b < job.buckets; ++b) bucket_next[b + 1] += bucket_next[b];
    owned = bucket_next[job.buckets];
    for (int64_t i = 0; i < count; ++i) {
      if (row_of[i] >= 0) order[bucket_next[row_of[i] >> shift]++] = static_cast<int32_t>(i);
    }
  }
  // Copy in that order, prefetching kPrefetchDistance rows ahead as the cached path does.
  const auto prefetch_row = [&](int64_t row) __attribute__((always_inline)) {
    prefetch_bytes(table + row * table_row_bytes, row_bytes);
    if constexpr (In == Dtype::kNvfp4) {
      prefetch_bytes(reinterpret_cast<const char*>(q.block_scales) +
                         row * q.block_scales_row_stride,
                     width / kNvfp4Block);
    }
  };
  for (int64_t j = 0; j < std::min(owned, kPrefetchDistance); ++j) prefetch_row(row_of[order[j]]);
  if constexpr (In == Out) {
    for (int64_t j = 0; j < owned; ++j) {
      if (j + kPrefetchDistance < owned) prefetch_row(row_of[order[j + kPrefetchDistance]]);
      const int64_t i = order[j];
      write_row<false>(stores, item_output(begin + i), table + row_of[i] * table_row_bytes,
                       row_bytes);
    }
  } else {
    const int64_t scale_bytes = In == Dtype::kNvfp4 ? width / kNvfp4Block : 0;
    const auto source = [&](int64_t j) __attribute__((always_inline)) {
      const int64_t row = row_of[order[j]];
      return std::pair<const char*, const uint8_t*>(
          table + row * table_row_bytes,
          In == Dtype::kNvfp4 ? q.block_scales + row * q.block_scales_row_stride : nullptr);
    };
    const auto prefetch = [&](int64_t j)
                              __attribute__((always_inline)) { prefetch_row(row_of[order[j]]); };
    // Converted through an L1-resident stage, then written with the path's stores; fp8 rows
    // with a vector lookup straight into streaming stores instead: the stage's extra write, read
    // and call per row made an fp8 prefill take 1.3x the time of a bf16 one at 2 threads (Zen 4).
    const auto emit = [&](int64_t j, const char* staged,
                          const uint8_t* scales) __attribute__((always_inline)) {
      char* dst = item_output(begin + order[j]);
      if constexpr (is_fp8(In)) {
        if (job.convert->fp8_rows_stream != nullptr && stores != RowStores::kPlain &&
            reinterpret_cast<uintptr_t>(dst) % job.convert->fp8_stream_align == 0) {
          job.convert->fp8_rows_stream(reinterpret_cast<const uint8_t*>(staged),
                                       reinterpret_cast<OutT*>(dst), width, *job.convert->fp8);
          return;
        }
      }
      constexpr int64_t kStage = kStageBytes / static_cast<int64_t>(sizeof(OutT));
      static_assert(kStage % kNvfp4Block == 0, "NVFP4 chunks must start on a block");
      alignas(64) OutT stage[kStage];
      for (int64_t c = 0; c < width; c += kStage) {
        const int64_t n = std::min(kStage, width - c);
        const auto* chunk = reinterpret_cast<const InT*>(staged) + c / elems_per_word(In);
        (*job.convert)(chunk, In == Dtype::kNvfp4 ? scales + c / kNvfp4Block : nullptr, stage, n);
        constexpr int64_t kOut = sizeof(OutT);
        write_row<false>(stores, dst + c * kOut, reinterpret_cast<const char*>(stage), n * kOut);
      }
    };
    convert_staged(owned, row_bytes, scale_bytes, source, prefetch, emit);
  }
#if QWEN4EXP_X86_AVX512
  // Streaming stores are weakly ordered: make them visible before this block counts as done.
  if (stores != RowStores::kPlain) _mm_sfence();
#endif
}

template <Dtype In, Dtype Out>
void streaming_gather(const GatherRowsParams& p, const RowConverter<In, Out>& convert,
                      RowStores stores, int64_t stream_bytes_from) {
  const int64_t items = p.num_tokens * p.num_heads;
  const int64_t threads = cpu::num_threads();
  const int64_t l2_items = std::max(kStreamMinBlockItems, cache_share().l2 / kStreamScratchBytes);
  const int64_t block_items =
      std::clamp<int64_t>((items + threads - 1) / threads, kStreamMinBlockItems, l2_items);
  // Buckets of 2^shift rows, about as many buckets as items in a block: finer buys nothing (a
  // bucket then holds ~1 item), coarser leaves rows unsorted within a bucket.
  const int64_t last_row = std::max<int64_t>(p.rows, 1) - 1;
  int64_t shift = 0;
  while ((last_row >> shift) >= block_items) ++shift;
  const StreamJob<In, Out> job{p,
                               &convert,
                               stores,
                               items,
                               block_items,
                               (items + block_items - 1) / block_items,
                               shift,
                               (last_row >> shift) + 1,
                               stream_bytes_from / threads};
  cpu::parallel_blocks(job.blocks, 1, [&](int64_t block) { stream_block(job, block); });
}

// set_cpu_gather_stream_bytes's setting; -1: the default. Read with one relaxed load per call.
std::atomic<int64_t> stream_bytes_setting{-1};

}  // namespace

void gather_rows_streaming(const GatherRowsParams& p, int64_t stream_bytes_from) {
  dispatch_gather_dtypes(p, [&](auto in, auto out) {
    constexpr Dtype In = decltype(in)::kDtype, Out = decltype(out)::kDtype;
    streaming_gather<In, Out>(p, RowConverter<In, Out>(p), best_row_stores(), stream_bytes_from);
  });
}

}  // namespace cpu

// Outputs of at least this many bytes take the streaming path; -1 where it is not available
// (no streaming stores: not x86-64, or no AVX). The default is what this process's threads can
// keep in cache (cache_share: per thread the core's L2 and its share of the L3); Python sets
// another (ops.set_cpu_gather_stream_bytes), so tests can force either path.
int64_t cpu_gather_stream_bytes() {
  if (cpu::best_row_stores() == cpu::RowStores::kPlain) return -1;
  const int64_t set = cpu::stream_bytes_setting.load(std::memory_order_relaxed);
  if (set >= 0) return set;
  const cpu::CacheShare& share = cpu::cache_share();
  return cpu::num_threads() * (share.l2 + share.l3);
}

int64_t set_cpu_gather_stream_bytes(int64_t bytes) {
  if (bytes < -1) {
    throw std::invalid_argument(
        "set_cpu_gather_stream_bytes: bytes must be >= 0 (or -1 for the "
        "default), got " +
        std::to_string(bytes));
  }
  return cpu::stream_bytes_setting.exchange(bytes);
}

}  // namespace qwen4exp
