// Exhaustive-edge and random check of csrc/common/fast_divmod.h (64- and 32-bit) against the
// hardware division.
// Built and run by tests/test_fast_divmod.py with the host C++ compiler (the header is torch-free
// and the same code runs on the CPU and GPU paths). Prints "ok <count>" or the first mismatch.
#include <cinttypes>
#include <cstdio>
#include <vector>

#include "common/fast_divmod.h"

using qwen4exp::FastDivmodU64;

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint64_t next_random() {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1Dull;
}

static int64_t reference_floor_mod(int64_t x, int64_t d) {
  int64_t r = x % d;  // truncates toward zero; INT64_MIN % d is well defined for d > 0
  return r < 0 ? r + d : r;
}

int main() {
  std::vector<uint64_t> divisors;
  for (uint64_t d = 1; d <= 2048; ++d) divisors.push_back(d);
  for (int k = 1; k < 64; ++k) {
    const uint64_t p = uint64_t{1} << k;
    divisors.insert(divisors.end(), {p - 1, p, p + 1});
  }
  // Released-model head sizes (primes just above 2e7) and extremes of the int64 range.
  for (uint64_t d : {20000003ull, 20000023ull, 20000171ull, 1009ull, 4294967291ull, 4294967311ull,
                     9223372036854775783ull, 9223372036854775807ull, 18446744073709551557ull,
                     18446744073709551615ull}) {
    divisors.push_back(d);
  }
  for (int i = 0; i < 2000; ++i) divisors.push_back(next_random() >> (next_random() % 64) | 1);

  uint64_t checks = 0;
  for (uint64_t d : divisors) {
    const FastDivmodU64 f = qwen4exp::make_fast_divmod(d);
    // The GPU builds its multiplier with the bit-serial division; the host with __int128.
    for (uint64_t hi : {uint64_t{0}, d - 1, d / 2, next_random() % d, next_random() % d}) {
      ++checks;
      if (qwen4exp::div_128_by_64_high_bitwise(hi, d) != qwen4exp::div_128_by_64_high(hi, d)) {
        std::printf("div_128 mismatch: hi=%" PRIu64 " d=%" PRIu64 "\n", hi, d);
        return 1;
      }
    }
    // clang-format off
    std::vector<uint64_t> numerators = {0, 1, 2, d - 1, d, d + 1, 2 * d - 1, 2 * d,
                                        ~uint64_t{0}, ~uint64_t{0} - 1, uint64_t{1} << 63,
                                        (uint64_t{1} << 63) - 1, (uint64_t{1} << 63) + 1};
    // clang-format on
    const uint64_t top = ~uint64_t{0} / d;  // largest multiple of d and its neighbours
    numerators.insert(numerators.end(), {top * d, top * d - 1, top * d + (d - 1)});
    for (int i = 0; i < 200; ++i) numerators.push_back(next_random());
    for (int i = 0; i < 50; ++i) numerators.push_back(next_random() % (d * 4 + 1));
    for (uint64_t n : numerators) {
      ++checks;
      if (qwen4exp::fast_div(f, n) != n / d || qwen4exp::fast_mod(f, n) != n % d) {
        std::printf("mismatch: n=%" PRIu64 " d=%" PRIu64 " got q=%" PRIu64 " r=%" PRIu64 "\n", n, d,
                    qwen4exp::fast_div(f, n), qwen4exp::fast_mod(f, n));
        return 1;
      }
      if (d <= static_cast<uint64_t>(INT64_MAX)) {
        const int64_t x = static_cast<int64_t>(n);
        const int64_t sd = static_cast<int64_t>(d);
        if (qwen4exp::floor_mod_i64(f, x) != reference_floor_mod(x, sd)) {
          std::printf("floor_mod mismatch: x=%" PRId64 " d=%" PRId64 " got %" PRId64 "\n", x, sd,
                      qwen4exp::floor_mod_i64(f, x));
          return 1;
        }
      }
    }
  }
  // The 32-bit form (the gather kernel's index arithmetic): every divisor up to 4096, powers of
  // two and their neighbours, the extremes and random ones, against edge and random numerators.
  std::vector<uint32_t> divisors32;
  for (uint32_t d = 1; d <= 4096; ++d) divisors32.push_back(d);
  for (int k = 1; k < 32; ++k) {
    const uint32_t p = uint32_t{1} << k;
    divisors32.insert(divisors32.end(), {p - 1, p, p + 1});
  }
  divisors32.insert(divisors32.end(), {0x7FFFFFFFu, 0x80000001u, 0xFFFFFFFEu, 0xFFFFFFFFu});
  for (int i = 0; i < 2000; ++i) {
    divisors32.push_back(static_cast<uint32_t>(next_random() >> (32 + next_random() % 32)) | 1);
  }
  for (uint32_t d : divisors32) {
    const qwen4exp::FastDivmodU32 f = qwen4exp::make_fast_divmod_u32(d);
    std::vector<uint32_t> numerators = {0,           1,           d - 1,      d,
                                        d + 1,       2 * d - 1,   2 * d,      0xFFFFFFFFu,
                                        0xFFFFFFFEu, 0x80000000u, 0x7FFFFFFFu};
    const uint32_t top = 0xFFFFFFFFu / d;
    numerators.insert(numerators.end(), {top * d, top * d - 1, top * d + (d - 1)});
    for (int i = 0; i < 200; ++i) numerators.push_back(static_cast<uint32_t>(next_random()));
    for (int i = 0; i < 50; ++i) {
      numerators.push_back(static_cast<uint32_t>(next_random() % (uint64_t{d} * 4 + 1)));
    }
    for (uint32_t n : numerators) {
      ++checks;
      if (qwen4exp::fast_div(f, n) != n / d) {
        std::printf("32-bit mismatch: n=%" PRIu32 " d=%" PRIu32 " got q=%" PRIu32 "\n", n, d,
                    qwen4exp::fast_div(f, n));
        return 1;
      }
    }
  }
  std::printf("ok %" PRIu64 "\n", checks);
  return 0;
}
