// HIP kernel for gather_rows (SPEC §4). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// The output [T, NH·d] is cut into 16-byte pieces of *table* row (8 bf16, 16 fp8, 4 fp32, 32
// NVFP4 elements): consecutive threads take consecutive pieces, so the bytes of one row are read
// by neighbouring lanes as one coalesced run and written likewise. Each thread first issues
// kUnroll independent 16-byte loads (from up to kUnroll different rows) and only then converts and
// stores: the gather is latency-bound, and loads in flight are what hide DRAM latency and, for a
// table in pinned host memory, the ~1-2 µs of a PCIe read. Rows of an fp8 table are dequantised
// through a 256-entry table of already-scaled, already-rounded outputs in shared memory, built
// per block, the same values the CPU kernel produces. An NVFP4 piece (two blocks of 16) loads its
// two block-scale bytes with its 16 bytes of codes, and each element is nvfp4_value's two
// multiplications and one rounding, as on the CPU.
//
// Ids are data: an id outside [vocab_start, vocab_end) writes a zero row (the vector kernel reads
// the table's first row in its place, an L2 hit after the first, and drops it), so no id value can
// make the kernel read out of bounds. Table offsets are 64-bit (row·stride exceeds
// 2^31 for the released 51.2-billion-element table). Per-piece index math is 32-bit, and its two
// divisions (piece -> row item -> token and head) are multiply-shifts by constants the launcher
// computes (fast_divmod.h): GPUs have no integer divider, and a 32-bit division is a
// ~20-instruction routine. An output of more pieces than 32 bits can index is gathered by several
// launches of whole tokens.
#include <algorithm>
#include <cstring>

#include "../common/dispatch.h"
#include "../common/fast_divmod.h"
#include "../common/gather_rows.h"
#include "../common/ngram_gather_rows.h"

namespace qwen4exp {
namespace {

constexpr int kThreadsPerBlock = 256;

// The one error code the launcher returns itself (an unknown dtype enum: unreachable from the
// glue).
constexpr hipError_t kInvalidValue = hipErrorInvalidValue;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread
constexpr int kVecBytes = 16;
// The pieces one launch of the vector kernel may gather: its grid-stride index (at most this plus
// the 2^20 blocks' kThreadsPerBlock · kUnroll pieces) stays below 2^31.
constexpr int64_t kMaxPieces =
    (int64_t{1} << 31) - int64_t{kThreadsPerBlock} * kUnroll * (int64_t{1} << 20);

struct alignas(16) Vec16 {
  uint32_t word[4];
};

template <Dtype In, Dtype Out>
struct PieceTraits {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  static constexpr int kElems = kVecBytes / static_cast<int>(sizeof(InT)) * elems_per_word(In);
  static constexpr int kOutBytes = kElems * static_cast<int>(sizeof(OutT));  // 8 to 128
};

// Writes the kOutBytes of one converted piece (dst is kOutBytes-aligned: the host checks it).
template <int kBytes>
QWEN4EXP_DEVICE void store_piece(void* dst, const void* src) {
  if constexpr (kBytes == 8) {
    uint2 v;
    memcpy(&v, src, 8);
    *static_cast<uint2*>(dst) = v;
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / kVecBytes; ++i) {
      Vec16 v;
      memcpy(&v, static_cast<const char*>(src) + i * kVecBytes, kVecBytes);
      static_cast<Vec16*>(dst)[i] = v;
    }
  }
}

template <Dtype Out>
struct DequantTable {
  storage_t<Out> value[256];
};

// Where the vector kernel's ids come from. IdsTensor (gather_rows): an [T, NH] tensor of IdT
// (int32_t or int64_t), fixed per kernel so that no branch separates one piece's loads from the
// next's. HashedIds (ngram_gather_rows): the n-gram hash of each (token, head), computed by the
// block into shared memory, once per row the block gathers, before its pieces load them (the ids
// are never written to global memory); kMaxContext as in ngram_hash.h's hashed_id (2: the
// released N = 3, the one order launch_hashed_typed takes).
template <typename IdT>
struct IdsTensor {
  static constexpr bool kHashed = false;
  const IdT* ids;
  int64_t row_stride, col_stride;
};
template <int kMaxContext>
struct HashedIds {
  static constexpr bool kHashed = true;
  static constexpr int kContext = kMaxContext;
  NgramIdsParams ngram;  // its output unused
};

// The rows of one block's pass over pieces [first, first + per_piece_count): at most this many.
QWEN4EXP_HD uint32_t items_per_pass(uint32_t pieces_per_pass, uint32_t pieces_per_row) {
  const uint32_t spanned = (pieces_per_pass - 1) / pieces_per_row + 2;
  return spanned < pieces_per_pass ? spanned : pieces_per_pass;
}

// pieces_per_row · num_heads · num_tokens = total_pieces < kMaxPieces; the table has a row.
// HashedIds: dynamic shared memory of FastDivmodU64[NH] then int64_t[items_per_pass(...)].
template <Dtype In, Dtype Out, typename Ids>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_rows_vec_kernel(GatherRowsParams p, Ids source, FastDivmodU32 pieces_per_row,
                           FastDivmodU32 num_heads, uint32_t total_pieces) {
  using Index = uint32_t;
  using Traits = PieceTraits<In, Out>;
  using InT = typename Traits::InT;
  using OutT = typename Traits::OutT;
  constexpr int kElems = Traits::kElems;

  constexpr bool kNvfp4 = In == Dtype::kNvfp4;
  static_assert(!kNvfp4 || kElems == 2 * kNvfp4Block, "an NVFP4 piece is two scale blocks");
  float global_scale = 0.0f;
  if constexpr (kNvfp4) global_scale = *p.scale;
  QWEN4EXP_SHARED(DequantTable<Out>, lut);
  if constexpr (is_fp8(In)) {
    const float scale_out = round_scale<Out>(*p.scale);
    // One entry per thread: a loop strided by blockDim.x was vectorised by hipcc, its uniform
    // 64-bit bookkeeping spilling SGPRs (fp16 outputs on gfx90a/gfx940).
    static_assert(kThreadsPerBlock == 256, "one dequantisation table entry per thread");
    lut.value[threadIdx.x] = dequantize<In, Out>(static_cast<uint8_t>(threadIdx.x), scale_out);
    __syncthreads();
  }
  FastDivmodU64* head_mod = nullptr;
  int64_t* pass_ids = nullptr;
  if constexpr (Ids::kHashed) {
    QWEN4EXP_DYNAMIC_SHARED(FastDivmodU64, hashed_shared);
    head_mod = hashed_shared;
    pass_ids = reinterpret_cast<int64_t*>(hashed_shared + source.ngram.num_heads);
    for (int h = threadIdx.x; h < source.ngram.num_heads; h += kThreadsPerBlock) {
      head_mod[h] = head_constants(source.ngram, h);
    }
    __syncthreads();
  }

  const char* table = static_cast<const char*>(p.table);
  const int64_t table_row_bytes = p.table_row_stride * static_cast<int64_t>(sizeof(InT));
  const Index per_block = static_cast<Index>(kThreadsPerBlock * kUnroll);
  // The whole block takes each pass (HashedIds has barriers in it).
  for (Index block_base = static_cast<Index>(blockIdx.x) * per_block; block_base < total_pieces;
       block_base += static_cast<Index>(gridDim.x) * per_block) {
    const Index base = block_base + static_cast<Index>(threadIdx.x);
    // A thread with no piece left leaves (no barrier waits for it): kept in the loop to the end
    // of the pass, the NVFP4 kernels held ~20 more VGPRs (6 waves per SIMD -> 5).
    if constexpr (!Ids::kHashed) {
      if (base >= total_pieces) break;
    }
    Index first_item = 0;
    if constexpr (Ids::kHashed) {
      // The ids of this pass's rows, one thread each.
      first_item = fast_div(pieces_per_row, block_base);
      const Index last_piece = total_pieces - block_base > per_block ? block_base + per_block - 1
                                                                     : total_pieces - 1;
      const Index items = fast_div(pieces_per_row, last_piece) - first_item + 1;
      for (Index i = threadIdx.x; i < items; i += kThreadsPerBlock) {
        const Index item = first_item + i;
        const Index t = fast_div(num_heads, item);
        const Index h = item - t * num_heads.divisor;
        pass_ids[i] =
            hashed_id<Ids::kContext>(source.ngram, head_mod, t, static_cast<int>(h), INT64_MAX);
      }
      __syncthreads();
    }
    Vec16 data[kUnroll];
    uint32_t scale_bytes[kUnroll];  // NVFP4: the piece's two block scales, first in the low byte
    OutT* dst[kUnroll];
    bool in_range[kUnroll];  // the piece exists (the last pass of the loop may have fewer)
    bool owned[kUnroll];     // ... and its id is one of this table's rows
    // Phase 1: every load of the kUnroll pieces, ids then rows, with no branch between them:
    // AMD's compiler waits for all outstanding loads where control flow joins, which left one
    // load in flight per thread. A piece past the end reads the id of the pass's first piece, an
    // id outside the table reads row 0 (the launcher sends tables without rows to the scalar
    // kernel); phase 2 writes neither's data.
    Index piece[kUnroll];
    int64_t id[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index v = base + static_cast<Index>(u * kThreadsPerBlock);
      in_range[u] = v < total_pieces;
      const Index at = in_range[u] ? v : block_base;
      const Index item = fast_div(pieces_per_row, at);
      piece[u] = at - item * pieces_per_row.divisor;
      const Index t = fast_div(num_heads, item);
      const Index h = item - t * num_heads.divisor;
      if constexpr (Ids::kHashed) {
        id[u] = pass_ids[item - first_item];
      } else {
        id[u] = static_cast<int64_t>(source.ids[static_cast<int64_t>(t) * source.row_stride +
                                                static_cast<int64_t>(h) * source.col_stride]);
      }
      // Null past the end. (A piece's pointer kept from here, rather than its index: nvcc then
      // keeps its stores 16 bytes wide.)
      dst[u] = in_range[u]
                   ? static_cast<OutT*>(p.output) + static_cast<int64_t>(t) * p.output_row_stride +
                         static_cast<int64_t>(h) * p.width + static_cast<int64_t>(piece[u]) * kElems
                   : nullptr;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t local = p.local_row(id[u]);
      owned[u] = in_range[u] && local >= 0;
      const int64_t row = owned[u] ? local : 0;
      data[u] = *reinterpret_cast<const Vec16*>(table + row * table_row_bytes +
                                                static_cast<int64_t>(piece[u]) * kVecBytes);
      scale_bytes[u] = 0;
      if constexpr (kNvfp4) {
        const uint8_t* scales =
            p.block_scales + row * p.block_scales_row_stride + static_cast<int64_t>(piece[u]) * 2;
        scale_bytes[u] = static_cast<uint32_t>(scales[0]) | (static_cast<uint32_t>(scales[1]) << 8);
      }
    }
    // Phase 2: convert and store.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] == nullptr) continue;
      if constexpr (kNvfp4) {
        // One scale block (16 elements) at a time: a whole piece's 32 converted elements would
        // be live at once (sm_90: 128 registers, 16 warps per SM, for fp32 outputs).
        uint8_t raw[kVecBytes];
        memcpy(raw, &data[u], kVecBytes);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float block_scale = fp8_e4m3fn_to_float((scale_bytes[u] >> (8 * half)) & 0xFFu);
          OutT converted[kNvfp4Block];
#pragma unroll
          for (int e = 0; e < kNvfp4Block; ++e) {
            const uint32_t code = (raw[half * kNvfp4Block / 2 + e / 2] >> ((e & 1) * 4)) & 0xFu;
            // Unowned rows are +0 whatever the scale (0 · inf would be NaN).
            converted[e] = owned[u] ? encode<Out>(nvfp4_value(code, block_scale, global_scale))
                                    : encode<Out>(0.0f);
          }
          store_piece<Traits::kOutBytes / 2>(dst[u] + half * kNvfp4Block, converted);
        }
      } else {
        OutT converted[kElems];
        if (!owned[u]) {
#pragma unroll
          for (int e = 0; e < kElems; ++e) converted[e] = encode<Out>(0.0f);
        } else if constexpr (In == Out) {
          memcpy(converted, &data[u], kVecBytes);
        } else {
          InT raw[kElems];
          memcpy(raw, &data[u], kVecBytes);
#pragma unroll
          for (int e = 0; e < kElems; ++e) {
            if constexpr (is_fp8(In)) {
              converted[e] = lut.value[raw[e]];
            } else {
              converted[e] = encode<Out>(decode<In>(raw[e]));
            }
          }
        }
        store_piece<Traits::kOutBytes>(dst[u], converted);
      }
    }
    if constexpr (Ids::kHashed) __syncthreads();  // the next pass rewrites pass_ids
  }
}

// Fallback for tables or outputs whose rows are not 16-byte aligned pieces (and for a token of
// more pieces than one vector launch takes): one thread per output element, 64-bit index math.
// Correct for every layout the host accepts, not tuned.
template <Dtype In, Dtype Out>
__global__ void __launch_bounds__(kThreadsPerBlock) gather_rows_scalar_kernel(GatherRowsParams p) {
  using InT = storage_t<In>;
  using OutT = storage_t<Out>;
  float scale_out = 0.0f;
  if constexpr (is_fp8(In)) scale_out = round_scale<Out>(*p.scale);
  float global_scale = 0.0f;
  if constexpr (In == Dtype::kNvfp4) global_scale = *p.scale;
  const int64_t total = p.num_tokens * p.num_heads * p.width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreadsPerBlock;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x; e < total;
       e += stride) {
    const int64_t item = e / p.width;
    const int64_t c = e - item * p.width;
    const int64_t t = item / p.num_heads;
    const int64_t h = item - t * p.num_heads;
    const int64_t row = p.local_row(p.id_at(t, h));
    OutT value = encode<Out>(0.0f);
    if (row >= 0) {
      if constexpr (In == Dtype::kNvfp4) {
        const uint8_t byte = static_cast<const uint8_t*>(p.table)[row * p.table_row_stride + c / 2];
        const uint32_t code = (static_cast<uint32_t>(byte) >> ((c & 1) * 4)) & 0xFu;
        const float block_scale =
            fp8_e4m3fn_to_float(p.block_scales[row * p.block_scales_row_stride + c / kNvfp4Block]);
        value = encode<Out>(nvfp4_value(code, block_scale, global_scale));
      } else {
        const InT x = static_cast<const InT*>(p.table)[row * p.table_row_stride + c];
        if constexpr (is_fp8(In)) {
          value = dequantize<In, Out>(x, scale_out);
        } else {
          value = encode<Out>(decode<In>(x));
        }
      }
    }
    static_cast<OutT*>(p.output)[t * p.output_row_stride + h * p.width + c] = value;
  }
}

bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// Enough blocks to cover the work once, at most 2^20 and at most max_blocks (p.max_blocks; 0: no
// cap); the grid-stride loops take any remainder. Every kernel here strides over its whole grid
// by gridDim.x blocks (the vector kernel's block_base, its ids from a tensor or hashed, and the
// scalar kernel's e), so a capped grid writes the same output, each block taking more passes.
unsigned grid_for(int64_t work, int64_t per_block, int64_t max_blocks) {
  int64_t blocks = (work + per_block - 1) / per_block;
  if (blocks > (int64_t{1} << 20)) blocks = int64_t{1} << 20;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

// The vector kernel's pieces per row for p, or 0 where it does not apply (rows or output not in
// 16-byte pieces, or a table without rows: the vector kernel reads row 0 for ids it does not own).
template <Dtype In, Dtype Out>
int64_t vector_pieces_per_row(const GatherRowsParams& p) {
  using Traits = PieceTraits<In, Out>;
  const int64_t in_size = static_cast<int64_t>(sizeof(typename Traits::InT));
  const int64_t out_size = static_cast<int64_t>(sizeof(typename Traits::OutT));
  const int64_t out_align = Traits::kOutBytes < kVecBytes ? Traits::kOutBytes : kVecBytes;
  const int64_t row_bytes = p.width * in_size / elems_per_word(In);
  const bool vectorizable =
      p.rows > 0 && row_bytes % kVecBytes == 0 && aligned(p.table, kVecBytes) &&
      (p.table_row_stride * in_size) % kVecBytes == 0 && aligned(p.output, out_align) &&
      (p.output_row_stride * out_size) % out_align == 0;
  return vectorizable ? row_bytes / kVecBytes : 0;
}

template <Dtype In, Dtype Out, typename Ids>
hipError_t launch_vector(const GatherRowsParams& p, const Ids& source, int64_t pieces_per_row,
                         int64_t total, size_t shared, hipStream_t stream) {
  return launch_kernel(
      gather_rows_vec_kernel<In, Out, Ids>,
      grid_for(total, int64_t{kThreadsPerBlock} * kUnroll, p.max_blocks), kThreadsPerBlock, shared,
      stream, p, source, make_fast_divmod_u32(static_cast<uint32_t>(pieces_per_row)),
      make_fast_divmod_u32(static_cast<uint32_t>(p.num_heads)), static_cast<uint32_t>(total));
}

template <Dtype In, Dtype Out>
hipError_t launch_typed(const GatherRowsParams& p, hipStream_t stream) {
  using OutT = typename PieceTraits<In, Out>::OutT;
  const int64_t pieces_per_row = vector_pieces_per_row<In, Out>(p);
  const int64_t per_token = p.num_heads * pieces_per_row;
  if (pieces_per_row > 0 && per_token < kMaxPieces) {
    const int64_t tokens_per_launch = (kMaxPieces - 1) / per_token;
    for (int64_t t0 = 0; t0 < p.num_tokens; t0 += tokens_per_launch) {
      GatherRowsParams part = p;
      part.num_tokens = std::min(tokens_per_launch, p.num_tokens - t0);
      part.output = static_cast<OutT*>(p.output) + t0 * p.output_row_stride;
      const int64_t total = part.num_tokens * per_token;
      const auto launch = [&](auto id_type) {
        using IdT = decltype(id_type);
        const IdsTensor<IdT> ids{static_cast<const IdT*>(p.ids) + t0 * p.ids_row_stride,
                                 p.ids_row_stride, p.ids_col_stride};
        return launch_vector<In, Out>(part, ids, pieces_per_row, total, 0, stream);
      };
      const hipError_t status = p.ids_int64 ? launch(int64_t{}) : launch(int32_t{});
      if (status != hipSuccess) return status;
    }
    return hipSuccess;
  }
  // Unaligned rows, a table without rows, or a single token of more than kMaxPieces pieces.
  const int64_t total = p.num_tokens * p.num_heads * p.width;
  return launch_kernel(gather_rows_scalar_kernel<In, Out>,
                       grid_for(total, kThreadsPerBlock, p.max_blocks), kThreadsPerBlock, 0, stream,
                       p);
}

// ngram_gather_rows in one launch of the vector kernel, its ids hashed by each block, where the
// vector kernel applies, one launch takes every piece, the n-gram order is the released N = 3 and
// the table is not NVFP4; else nothing is launched and *launched is false. (The generic-order
// window and the NVFP4 decode, each next to the hash's live state and both ops' arguments,
// spilled registers: SGPRs on gfx90a/gfx940, registers to the stack on sm_90.)
template <Dtype In, Dtype Out>
hipError_t launch_hashed_typed(const NgramGatherRowsParams& q, hipStream_t stream, bool* launched) {
  *launched = false;
  if constexpr (In == Dtype::kNvfp4) {
    return hipSuccess;
  } else {
    const GatherRowsParams& p = q.gather;
    const int64_t pieces_per_row = vector_pieces_per_row<In, Out>(p);
    const int64_t total = p.num_tokens * p.num_heads * pieces_per_row;
    if (q.ngram.context_len != 2 || pieces_per_row == 0 || total >= kMaxPieces) return hipSuccess;
    *launched = true;
    const uint32_t per_pass = static_cast<uint32_t>(kThreadsPerBlock * kUnroll);
    const size_t shared =
        sizeof(FastDivmodU64) * static_cast<size_t>(q.ngram.num_heads) +
        sizeof(int64_t) * items_per_pass(per_pass, static_cast<uint32_t>(pieces_per_row));
    return launch_vector<In, Out>(p, HashedIds<2>{q.ngram}, pieces_per_row, total, shared, stream);
  }
}

}  // namespace

hipError_t launch_gather_rows(const GatherRowsParams& p, hipStream_t stream) {
  const auto invalid = [] { return kInvalidValue; };
  return dispatch_dtype(
      kTableDtypes, p.table_dtype,
      [&](auto in) {
        return dispatch_dtype(
            kFloatDtypes, p.out_dtype,
            [&](auto out) {
              return launch_typed<decltype(in)::kDtype, decltype(out)::kDtype>(p, stream);
            },
            invalid);
      },
      invalid);
}

hipError_t launch_ngram_gather_rows(const NgramGatherRowsParams& p, hipStream_t stream,
                                    bool* launched) {
  *launched = false;
  const auto invalid = [] { return kInvalidValue; };
  return dispatch_dtype(
      kTableDtypes, p.gather.table_dtype,
      [&](auto in) {
        return dispatch_dtype(
            kFloatDtypes, p.gather.out_dtype,
            [&](auto out) {
              return launch_hashed_typed<decltype(in)::kDtype, decltype(out)::kDtype>(p, stream,
                                                                                      launched);
            },
            invalid);
      },
      invalid);
}

}  // namespace qwen4exp
