// Exact 64-bit modulo by an invariant divisor without a hardware division.
//
// ngram_ids reduces one 64-bit hash per (token, head) modulo the head's prime size. A 64-bit
// division is a ~70-instruction software routine on both AMD and NVIDIA GPUs (neither has a
// 64-bit integer divider) and 15-40 cycles on x86, so each divisor is turned once into a
// multiplier and shifts, and every reduction then costs one 64x64->128 high multiply.
//
// Method: Granlund & Montgomery, "Division by Invariant Integers using Multiplication" (PLDI
// 1994), Figure 4.1 / Theorem 4.2, for N = 64-bit unsigned operands:
//   l   = ceil(log2 d)                         (0 <= l <= 64 for 1 <= d < 2^64)
//   m'  = floor(2^64 · (2^l − d) / d) + 1      (fits in 64 bits because 2^l − d < d)
//   t1  = MULUH(m', n)
//   q   = SRL(t1 + SRL(n − t1, sh1), sh2),     sh1 = min(l, 1), sh2 = max(l − 1, 0)
// gives q = floor(n / d) for every 0 <= n < 2^64 and 1 <= d < 2^64: the theorem bounds the
// error of m'/2^(64+l) against 1/d by 2^-64/d, which is below one unit of q, and the SRL/add form
// evaluates floor((m'·n/2^64 + n) / 2^l) without the 65-bit intermediate overflowing
// (t1 <= n, so n − t1 and (n − t1)/2 + t1 <= n stay in range). d = 1 (l = 0, m' = 1, t1 = 0)
// and powers of two (m' = 1, t1 = 0, q = n >> l) are covered by the same formula.
// tests/test_fast_divmod.py checks it against 128-bit division on edge and random operands.
//
// Signed floor modulo (torch.remainder semantics, a result in [0, d) for negative x too): with
// u = x mod 2^64 and x < 0, x = u − 2^64, so x mod d = (u mod d − 2^64 mod d) mod d; 2^64 mod d is
// precomputed, which leaves one compare-and-add.
#pragma once

#include <cstddef>

#include "platform.h"

namespace qwen4exp {

struct FastDivmodU64 {
  uint64_t divisor;     // d >= 1
  uint64_t multiplier;  // m'
  uint32_t shift1;      // sh1
  uint32_t shift2;      // sh2
  uint64_t two64_mod;   // 2^64 mod d, for the signed floor modulo
};

// ngram_ids takes a layer's constants precomputed (ops.ngram_head_divmod) as an int64 tensor
// [NH, 4] holding exactly these bytes: divisor, multiplier, shift1 | shift2 << 32 (one int64 slot,
// little-endian as every target is), two64_mod. The GPU kernel copies them with 16-byte loads.
constexpr int kFastDivmodWords = 4;  // int64 slots per FastDivmodU64
static_assert(sizeof(FastDivmodU64) == kFastDivmodWords * sizeof(int64_t),
              "FastDivmodU64 is one [4] int64 row of ngram_ids' head_divmod tensor");
static_assert(offsetof(FastDivmodU64, divisor) == 0 && offsetof(FastDivmodU64, multiplier) == 8 &&
                  offsetof(FastDivmodU64, shift1) == 16 && offsetof(FastDivmodU64, shift2) == 20 &&
                  offsetof(FastDivmodU64, two64_mod) == 24,
              "head_divmod's layout: divisor, multiplier, shift1 | shift2 << 32, two64_mod");

// floor((hi · 2^64) / d) for hi < d: restoring long division, one quotient bit per step. Runs
// once per divisor (per kernel block on the GPU), never per element; portable where a 128-bit
// division is not (ROCm 5.x device code has no __udivti3). tests/cpp checks it against __int128.
QWEN4EXP_HD uint64_t div_128_by_64_high_bitwise(uint64_t hi, uint64_t d) {
  uint64_t quotient = 0;
  uint64_t remainder = hi;  // < d
  for (int bit = 63; bit >= 0; --bit) {
    const bool carry = (remainder >> 63) != 0;  // remainder·2 would need 65 bits
    remainder <<= 1;
    if (carry || remainder >= d) {
      remainder -= d;  // wraps correctly when carry is set: the true value is < 2d
      quotient |= uint64_t{1} << bit;
    }
  }
  return quotient;
}

QWEN4EXP_HD uint64_t div_128_by_64_high(uint64_t hi, uint64_t d) {
#if defined(QWEN4EXP_DEVICE_PASS)
  return div_128_by_64_high_bitwise(hi, d);
#else
  // Host: the compiler's 128-bit division is exact and far faster than the bit loop, which
  // matters for small CPU calls (16 divisors per call at decode).
  return static_cast<uint64_t>((static_cast<unsigned __int128>(hi) << 64) / d);
#endif
}

QWEN4EXP_HD uint64_t fast_div(const FastDivmodU64& f, uint64_t n) {
  const uint64_t t1 = mul_hi_u64(f.multiplier, n);
  return (t1 + ((n - t1) >> f.shift1)) >> f.shift2;
}

QWEN4EXP_HD uint64_t fast_mod(const FastDivmodU64& f, uint64_t n) {
  return n - fast_div(f, n) * f.divisor;
}

// Precondition: d >= 1 (callers validate; a GPU kernel maps d <= 0 to an invalid id itself).
QWEN4EXP_HD FastDivmodU64 make_fast_divmod(uint64_t d) {
  uint32_t l = 0;
  while (l < 64 && (uint64_t{1} << l) < d) ++l;  // ceil(log2 d)
  // 2^l − d mod 2^64; for l = 64 this is 2^64 − d, which unsigned negation gives directly.
  const uint64_t excess = (l == 64) ? (uint64_t{0} - d) : ((uint64_t{1} << l) - d);
  FastDivmodU64 f;
  f.divisor = d;
  f.multiplier = div_128_by_64_high(excess, d) + 1;
  f.shift1 = l < 1 ? l : 1;
  f.shift2 = l > 1 ? l - 1 : 0;
  f.two64_mod = 0;
  f.two64_mod = fast_mod(f, uint64_t{0} - d);  // (2^64 − d) mod d == 2^64 mod d
  return f;
}

// floor_mod(x, d) in [0, d) for any int64 x.
QWEN4EXP_HD int64_t floor_mod_i64(const FastDivmodU64& f, int64_t x) {
  // Branch-free: the sign of a hash is a coin flip, so a branch here would mispredict half the
  // time on the CPU and diverge on the GPU.
  const uint64_t r = fast_mod(f, static_cast<uint64_t>(x));
  const uint64_t correction = x < 0 ? f.two64_mod : 0;
  const uint64_t shifted = r - correction;
  return static_cast<int64_t>(r < correction ? shifted + f.divisor : shifted);
}

// The same method for N = 32: the gather kernel's per-piece index arithmetic (piece -> row item,
// item -> token and head), where a 32-bit division is a ~20-instruction routine on GPUs (neither
// vendor has an integer divider) and this is a high multiply, a subtraction, an add and two shifts.
// Exact for every 0 <= n < 2^32 and 1 <= d < 2^32 (the theorem above with N = 32; the additions
// stay below 2^32 as t1 <= n). Built on the host, once per launch.
struct FastDivmodU32 {
  uint32_t divisor;     // d >= 1
  uint32_t multiplier;  // m' = floor(2^32 · (2^l − d) / d) + 1, below 2^32 since 2^l − d < d
  uint32_t shift1;      // min(l, 1)
  uint32_t shift2;      // max(l − 1, 0)
};

// Precondition: d >= 1.
QWEN4EXP_HD FastDivmodU32 make_fast_divmod_u32(uint32_t d) {
  uint32_t l = 0;
  while (l < 32 && (uint64_t{1} << l) < d) ++l;    // ceil(log2 d)
  const uint64_t excess = (uint64_t{1} << l) - d;  // < d
  FastDivmodU32 f;
  f.divisor = d;
  f.multiplier = static_cast<uint32_t>((excess << 32) / d + 1);
  f.shift1 = l < 1 ? l : 1;
  f.shift2 = l > 1 ? l - 1 : 0;
  return f;
}

QWEN4EXP_HD uint32_t fast_div(const FastDivmodU32& f, uint32_t n) {
  const uint32_t t1 = mul_hi_u32(f.multiplier, n);
  return (t1 + ((n - t1) >> f.shift1)) >> f.shift2;
}

}  // namespace qwen4exp
