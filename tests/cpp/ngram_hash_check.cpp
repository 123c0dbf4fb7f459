// Check of ngram_ids' head reduction in every width this CPU has (csrc/cpu/ngram_hash_simd.cpp:
// scalar, AVX2, AVX-512) against a floor modulo by the hardware's 128-bit division: mixes at the
// edges of int64 and random ones, head sizes from 1 to 2^63 - 1, every head count from 1 to 40
// (tails of every length), int64 and int32 outputs, contiguous and strided. Catches in isolation
// what the Python tests see through the op, and, built with sanitizers (tools/check-sanitizers.sh),
// a vector store past a tail or a read of uninitialised mixes.
// Built and run by tests/ngram_ids/test_cpu_hash_widths.py with the host C++ compiler. Prints
// "ok <ids checked>" or the first mismatch.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "common/ngram_ids.h"
#include "cpu/ngram_hash_simd.h"

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint64_t next_random() {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1Dull;
}

int64_t floor_mod(int64_t x, int64_t d) {
  const __int128 r = static_cast<__int128>(x) % d;
  return static_cast<int64_t>(r < 0 ? r + d : r);
}

const int64_t kMax = INT64_MAX;
const uint64_t kEdgeMixes[] = {0,
                               1,
                               2,
                               1008,
                               1009,
                               0x7FFFFFFF,
                               0x80000000,
                               0xFFFFFFFF,
                               0x100000000,
                               0x100000001,
                               uint64_t{1} << 62,
                               static_cast<uint64_t>(kMax) - 1,
                               static_cast<uint64_t>(kMax),
                               uint64_t{1} << 63,
                               (uint64_t{1} << 63) + 1,
                               ~uint64_t{0} - 0xFFFFFFFF,
                               ~uint64_t{0} - 1008,
                               ~uint64_t{0} - 1,
                               ~uint64_t{0}};
const int64_t kEdgeSizes[] = {1,
                              2,
                              3,
                              7,
                              1009,
                              0x7FFFFFFF,
                              0x80000000,
                              0xFFFFFFFF,
                              0x100000000,
                              0x100000001,
                              20000003,
                              int64_t{1} << 62,
                              (int64_t{1} << 62) + 1,
                              kMax - 24,
                              kMax - 1,
                              kMax};

int64_t random_size() {
  switch (next_random() % 4) {
    case 0: return kEdgeSizes[next_random() % (sizeof(kEdgeSizes) / sizeof(kEdgeSizes[0]))];
    case 1: return static_cast<int64_t>(next_random() % 100000) + 1;
    case 2: return static_cast<int64_t>(next_random() >> (next_random() % 63 + 1)) + 1;
    default: return static_cast<int64_t>(next_random() >> 1) | 1;  // near 2^63
  }
}

uint64_t random_mix(int64_t size) {
  const uint64_t s = static_cast<uint64_t>(size);
  switch (next_random() % 4) {
    case 0: return kEdgeMixes[next_random() % (sizeof(kEdgeMixes) / sizeof(kEdgeMixes[0]))];
    case 1:  // a multiple of the size and its neighbours, either sign
      return (next_random() % 4 + 1) * s + next_random() % 3 - 1;
    case 2: return uint64_t{0} - ((next_random() % 4 + 1) * s + next_random() % 3 - 1);
    default: return next_random();
  }
}

template <typename OutT>
bool check(int64_t isa, const char* name, int heads, int per_order, int64_t tokens,
           int64_t col_stride, uint64_t* count) {
  std::vector<int64_t> sizes(heads), offsets(heads);
  const bool narrow = sizeof(OutT) == 4;
  int64_t total = 0;
  for (int h = 0; h < heads; ++h) {
    if (narrow) {  // the ids must fit int32: small heads, their offsets the prefix sums
      sizes[h] = random_size() % 100000 + 1;
      offsets[h] = total;
      total += sizes[h];
    } else {  // any offset that keeps off + size within int64 (0 where the size leaves no room)
      sizes[h] = random_size();
      const uint64_t room = static_cast<uint64_t>(kMax - sizes[h]);
      offsets[h] = room > 0 ? static_cast<int64_t>(next_random() % room) : 0;
    }
  }
  const qwen4exp::cpu::HeadLanes lanes(sizes.data(), offsets.data(), heads, per_order);
  const int orders = (heads + per_order - 1) / per_order;
  std::vector<uint64_t> mixes(static_cast<size_t>(tokens) * qwen4exp::cpu::kMixSlots, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int o = 0; o < orders; ++o)
      mixes[t * qwen4exp::cpu::kMixSlots + o] = random_mix(sizes[o * per_order]);
  }
  // Rows of `heads` ids `col_stride` apart, two sentinel columns at the end of each row.
  const int64_t row_stride = heads * col_stride + 2;
  const OutT sentinel = static_cast<OutT>(-7);
  std::vector<OutT> out(static_cast<size_t>(tokens * row_stride), sentinel);
  qwen4exp::cpu::reduce_heads(isa, lanes, mixes.data(), tokens, out.data(), row_stride, col_stride);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < row_stride; ++k) {
      const OutT got = out[t * row_stride + k];
      const bool is_id = k % col_stride == 0 && k / col_stride < heads;
      if (!is_id) {
        if (got != sentinel) {
          std::printf("FAIL %s: wrote %" PRId64 " at token %" PRId64 " column %" PRId64
                      " (not an id's)\n",
                      name, static_cast<int64_t>(got), t, k);
          return false;
        }
        continue;
      }
      const int h = static_cast<int>(k / col_stride);
      const uint64_t mix = mixes[t * qwen4exp::cpu::kMixSlots + h / per_order];
      const OutT want =
          static_cast<OutT>(floor_mod(static_cast<int64_t>(mix), sizes[h]) + offsets[h]);
      if (got != want) {
        std::printf("FAIL %s: mix %" PRIu64 " size %" PRId64 " offset %" PRId64
                    " (head %d of %d, "
                    "token %" PRId64 "): got %" PRId64 ", want %" PRId64 "\n",
                    name, mix, sizes[h], offsets[h], h, heads, t, static_cast<int64_t>(got),
                    static_cast<int64_t>(want));
        return false;
      }
      ++*count;
    }
  }
  return true;
}

}  // namespace

int main() {
  struct Width {
    int64_t isa;
    const char* name;
  };
  const Width widths[] = {{qwen4exp::kNgramHashScalar, "scalar"},
                          {qwen4exp::kNgramHashAvx2, "avx2"},
                          {qwen4exp::kNgramHashAvx512, "avx512"}};
  uint64_t count = 0;
  int tested = 0;
  for (const Width& w : widths) {
    try {  // a width this CPU lacks is refused: skip it
      qwen4exp::set_cpu_ngram_hash_isa(w.isa);
    } catch (const std::exception&) {
      continue;
    }
    if (qwen4exp::cpu_ngram_hash_isa() != w.isa) {
      std::printf("FAIL %s: pinned, but cpu_ngram_hash_isa() says %" PRId64 "\n", w.name,
                  qwen4exp::cpu_ngram_hash_isa());
      return 1;
    }
    ++tested;
    for (int heads = 1; heads <= 40; ++heads) {
      for (int per_order = 1; per_order <= heads; ++per_order) {
        if ((heads + per_order - 1) / per_order > qwen4exp::kMaxNgramSize - 1) continue;
        const int64_t tokens = static_cast<int64_t>(next_random() % 9) + 1;
        const int64_t stride = per_order % 3 == 0 ? 3 : 1;
        if (!check<int64_t>(w.isa, w.name, heads, per_order, tokens, stride, &count) ||
            !check<int32_t>(w.isa, w.name, heads, per_order, tokens, stride, &count)) {
          return 1;
        }
      }
    }
  }
  qwen4exp::set_cpu_ngram_hash_isa(qwen4exp::kNgramHashBest);
  std::printf("ok %" PRIu64 " ids in %d widths\n", count, tested);
  return tested > 0 ? 0 : 1;
}
