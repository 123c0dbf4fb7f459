// ngram_ids' head reduction on the CPU (issue #51 item 2): every head's id of a block of tokens
// from their mixes, floor_mod(mix, size_h) + off_h, a head per lane, through the fast-modulo
// constants of csrc/common/fast_divmod.h: with AVX-512 (8 heads a step), AVX2 (4) or a head at a
// time, picked at run time (cpu_ngram_hash_isa, csrc/common/ngram_ids.h). The same exact
// arithmetic in every width, so every width gives the same ids bit for bit.
//
// The kernel (csrc/cpu/ngram_ids.cpp) walks the windows a token at a time and fills a block of
// mixes; reduce_heads then turns the block into ids. x86 has no 64x64->128 multiply in vectors:
// its high half is built from four 32x32->64 multiplies, and AVX2's low 64-bit product from three
// (AVX-512DQ has one), which still leaves 4 or 8 heads a step ahead of the scalar mulx.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/fast_divmod.h"

namespace qwen4exp::cpu {

// Mixes per token in a block (orders 2..N, at most kMaxNgramSize - 1 = 7 of them), padded to 8:
// one AVX-512 vector, from which each lane picks its head's order.
constexpr int kMixSlots = 8;
// Tokens per block: their mixes (4 KiB) stay in L1 while every head's lanes pass over them.
constexpr int kMixBlockTokens = 64;

// Lanes per vector of the widest kernel: the per-head constants are padded to a multiple of it.
constexpr int kHeadLanes = 8;

// One layer's per-head constants, built once per call: the scalar kernel's FastDivmodU64 per
// head, and the same values as structure-of-arrays rows (one uint64 per head, padded to a
// multiple of kHeadLanes with the constants of 1, order 0 and offset 0, never stored) for the
// vector kernels' loads.
class HeadLanes {
 public:
  enum Row {
    kMultiplier,      // FastDivmodU64::multiplier
    kMultiplierHigh,  // its high 32 bits (the 32x32 multiplies' operand)
    kDivisor,
    kDivisorHigh,  // its high 32 bits (AVX2's low product)
    kShift1,
    kShift2,
    kTwo64Mod,
    kOffset,     // off_h, as uint64 bits
    kOrder,      // the head's mix slot, (h / K_h): AVX-512's permute index
    kOrderPair,  // AVX2's 32-bit permute indices of the slot within its half: 2j | (2j + 1) << 32
    kOrderHigh,  // all ones where the slot is in the upper half (4..7), for AVX2's blend
    kRows
  };

  HeadLanes(const int64_t* sizes, const int64_t* offsets, int num_heads, int heads_per_ngram);

  int num_heads() const { return num_heads_; }
  int padded() const { return padded_; }
  const FastDivmodU64& divmod(int h) const { return divmod_[h]; }
  int64_t offset(int h) const { return static_cast<int64_t>(row(kOffset)[h]); }
  int order(int h) const { return static_cast<int>(row(kOrder)[h]); }
  const uint64_t* row(Row r) const { return rows_.data() + static_cast<size_t>(r) * padded_; }

 private:
  int num_heads_;
  int padded_;
  std::vector<FastDivmodU64> divmod_;
  std::vector<uint64_t> rows_;
};

// out[t·row_stride + h·col_stride] = floor_mod(mixes[t·kMixSlots + order(h)], size_h) + off_h for
// t < tokens and every head h, in the width `isa` names (kNgramHashScalar/Avx2/Avx512 of
// csrc/common/ngram_ids.h; the caller has checked the CPU has it). Every slot of a token's mixes
// must be initialised (the vector kernels load all eight).
void reduce_heads(int64_t isa, const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens,
                  int64_t* out, int64_t row_stride, int64_t col_stride);
void reduce_heads(int64_t isa, const HeadLanes& lanes, const uint64_t* mixes, int64_t tokens,
                  int32_t* out, int64_t row_stride, int64_t col_stride);

}  // namespace qwen4exp::cpu
