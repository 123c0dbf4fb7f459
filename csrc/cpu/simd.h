// Eight-lane fp32 vectors for the CPU kernels (GCC/Clang vector extensions), with loads and
// stores of fp32, bf16 and fp16 rows, the function multi-versioning of the hot loops, and the CPU
// feature queries of the paths chosen at run time.
//
// The wheel is built for baseline x86-64 (SSE2). Hot loops are written on these vectors and
// compiled a second and third time for AVX2+FMA (x86-64-v3) and AVX-512 (x86-64-v4) through GCC's
// target_clones: the loader picks the best clone once, for the CPU it runs on. Templated bodies
// are force-inlined into the clones so they get the clone's instruction set. Eight lanes is also
// the lane count of numpy's pairwise summation, which ple_gate's "vllm" rounding reproduces.
//
// 16-bit conversions are the integer round-to-nearest-even of float16.h, lane by lane.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/float_types.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(QWEN4EXP_NO_CPU_CLONES)
#define QWEN4EXP_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QWEN4EXP_CPU_CLONES
#endif

// Paths beyond the clones (intrinsics the baseline clone cannot name: gathers, streaming stores,
// in-register tables) are compiled on x86-64 with per-function target attributes and chosen at
// run time with the cpu_has_* queries below: the wheel itself stays baseline x86-64.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QWEN4EXP_X86_AVX512 1
#else
#define QWEN4EXP_X86_AVX512 0
#endif

#define QWEN4EXP_ALWAYS_INLINE inline __attribute__((always_inline))
// Lambdas in a clone are separate functions compiled for the baseline target: force them inline,
// or their vector code (and their vector ABI) would not be the clone's.
#define QWEN4EXP_LAMBDA_INLINE __attribute__((always_inline))

// The vector types below are passed only between force-inlined functions inside one clone, so
// GCC's note that their calling convention differs between instruction sets does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace qwen4exp {
namespace simd {

constexpr int kLanes = 8;

// What the bf16 roundings of blocks may assume about NaNs. kAny: a NaN may carry payload bits in
// its low half (fp32 data), which the rounding add could carry into the sign, so a select keeps
// it NaN. kLowHalfZero: every NaN rounded has a zero low half, as has every NaN that fp32
// arithmetic makes from bf16 values, from NaNs rounded to bf16 and from non-NaN fp32 values (x86
// and Arm return a NaN operand's payload, quieted, or the default NaN): the add cannot carry out
// of the low half, the result is the NaN's own quiet high half, and the select is dropped.
enum class NaNs { kAny, kLowHalfZero };

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

QWEN4EXP_ALWAYS_INLINE f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
QWEN4EXP_ALWAYS_INLINE u32x8 splat_u(uint32_t x) { return u32x8{x, x, x, x, x, x, x, x}; }
QWEN4EXP_ALWAYS_INLINE f32x8 as_f32(u32x8 u) { return (f32x8)u; }
QWEN4EXP_ALWAYS_INLINE u32x8 as_u32(f32x8 f) { return (u32x8)f; }

// ---- 16-bit patterns <-> fp32 lanes (exact RNE, NaN stays NaN) -------------------------------

QWEN4EXP_ALWAYS_INLINE f32x8 bf16x8_to_f32(u16x8 h) {
  return as_f32(__builtin_convertvector(h, u32x8) << 16);
}

QWEN4EXP_ALWAYS_INLINE u32x8 f32_to_bf16x8_bits(f32x8 x) {  // in the low 16 bits of each lane
  const u32x8 u = as_u32(x);
  const u32x8 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const u32x8 nan = (u >> 16) | 0x40u;
  return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? nan : rounded;
}

// fp16 bits in the low half of each lane (the high half zero).
QWEN4EXP_ALWAYS_INLINE f32x8 f16_bits_to_f32(u32x8 h) {
  const u32x8 sign = (h & 0x8000u) << 16;
  const u32x8 exponent = (h >> 10) & 0x1Fu;
  const u32x8 mantissa = h & 0x3FFu;
  const u32x8 normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  const u32x8 special = sign | 0x7F800000u | (mantissa << 13);
  const f32x8 sub_magnitude = __builtin_convertvector(mantissa, f32x8) * 5.9604644775390625e-8f;
  const u32x8 subnormal = sign | as_u32(sub_magnitude);
  return as_f32(exponent == 31u ? special : (exponent != 0u ? normal : subnormal));
}
QWEN4EXP_ALWAYS_INLINE f32x8 f16x8_to_f32(u16x8 h) {
  return f16_bits_to_f32(__builtin_convertvector(h, u32x8));
}

QWEN4EXP_ALWAYS_INLINE u32x8 f32_to_f16x8_bits(f32x8 x) {
  const u32x8 u = as_u32(x);
  const u32x8 sign = (u >> 16) & 0x8000u;
  const u32x8 a = u & 0x7FFFFFFFu;
  const u32x8 nan = sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  const u32x8 inf = sign | 0x7C00u;
  const u32x8 r = a - 0x38000000u;
  const u32x8 normal = sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  // |x| < 2^-14: |x|·2^24 is exact; adding 2^23 rounds it to an integer, to nearest even.
  const f32x8 scaled = as_f32(a) * 16777216.0f + 8388608.0f;
  const u32x8 subnormal = sign | (as_u32(scaled) - 0x4B000000u);
  return a > 0x7F800000u ? nan : (a >= 0x477FF000u ? inf : (a >= 0x38800000u ? normal : subnormal));
}

// ---- typed loads, stores and rounding ---------------------------------------------------------

QWEN4EXP_ALWAYS_INLINE f32x8 load(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
QWEN4EXP_ALWAYS_INLINE f32x8 load(const bf16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return bf16x8_to_f32(h);
}
QWEN4EXP_ALWAYS_INLINE f32x8 load(const f16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return f16x8_to_f32(h);
}

// Storage bits of x in T, as 16-bit lanes (16-bit T only).
template <typename T>
QWEN4EXP_ALWAYS_INLINE u16x8 to_bits(f32x8 x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return __builtin_convertvector(f32_to_bf16x8_bits(x), u16x8);
  } else {
    return __builtin_convertvector(f32_to_f16x8_bits(x), u16x8);
  }
}

QWEN4EXP_ALWAYS_INLINE void store(float* p, f32x8 x) { std::memcpy(p, &x, sizeof(x)); }
QWEN4EXP_ALWAYS_INLINE void store(bf16_t* p, f32x8 x) {
  const u16x8 h = to_bits<bf16_t>(x);
  std::memcpy(p, &h, sizeof(h));
}
QWEN4EXP_ALWAYS_INLINE void store(f16_t* p, f32x8 x) {
  const u16x8 h = to_bits<f16_t>(x);
  std::memcpy(p, &h, sizeof(h));
}

// x rounded to T and read back. (8-lane steps are tails: they always check for NaNs.)
template <typename T, NaNs = NaNs::kAny>
QWEN4EXP_ALWAYS_INLINE f32x8 round(f32x8 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return as_f32(f32_to_bf16x8_bits(x) << 16);
  } else {
    return f16_bits_to_f32(f32_to_f16x8_bits(x));
  }
}

// The first n (< 8) elements, zero-padded; and the matching partial store.
template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x8 load_partial(const T* p, int n) {
  T tmp[kLanes];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, sizeof(T) * n);
  return load(tmp);
}
template <typename T>
QWEN4EXP_ALWAYS_INLINE void store_partial(T* p, f32x8 x, int n) {
  T tmp[kLanes];
  store(tmp, x);
  std::memcpy(static_cast<void*>(p), tmp, sizeof(T) * n);
}
// Lanes [0, n) of a row, for n in [1, 8].
template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x8 load_n(const T* p, int n) {
  return n == kLanes ? load(p) : load_partial(p, n);
}
template <NaNs = NaNs::kAny, typename T>
QWEN4EXP_ALWAYS_INLINE void store_n(T* p, f32x8 x, int n) {
  if (n == kLanes) {
    store(p, x);
  } else {
    store_partial(p, x, n);
  }
}

// ---- 16-element blocks ----------------------------------------------------------------------
//
// Rows can also move in blocks of 16 elements held as two 8-lane vectors. A block of 16-bit
// values is split into its even and odd elements: one 32-byte load, then per half a shift or a
// mask (and fp16's decode), where GCC 12 widens 8 of them in order in six instructions (two
// 128-bit zero-extensions, an insert and a shift); the store merges the halves back the same
// way. fp32 blocks are held in order. Element-wise arithmetic cannot tell the difference;
// whatever is indexed by element (a weight row, the lanes of an ordered sum) must follow
// block_position.

// The split reads element 2i from the low half of a 32-bit word: on a big-endian CPU the halves
// would swap and block_position (so the weight layouts and the ordered sums) would be wrong.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "simd.h's 16-element blocks assume a little-endian CPU");

struct Block16 {};  // step tag: a whole block, see for_each_block
constexpr int kBlock = 16;

struct f32x16 {
  f32x8 lo, hi;  // 16-bit types: the even and the odd elements; fp32: [0, 8) and [8, 16)
};
QWEN4EXP_ALWAYS_INLINE f32x16 operator+(f32x16 a, f32x16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
QWEN4EXP_ALWAYS_INLINE f32x16 operator*(f32x16 a, f32x16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
QWEN4EXP_ALWAYS_INLINE f32x16 operator*(f32x16 a, f32x8 b) { return {a.lo * b, a.hi * b}; }
QWEN4EXP_ALWAYS_INLINE f32x16 operator*(f32x8 a, f32x16 b) { return {a * b.lo, a * b.hi}; }
QWEN4EXP_ALWAYS_INLINE f32x16& operator+=(f32x16& a, f32x16 b) { return a = a + b; }

template <typename T>
constexpr bool kSplitsEvenOdd = sizeof(T) == 2;

// Where element k (0 <= k < 16) of a block of T sits in its f32x16, counting lo's lanes first.
template <typename T>
constexpr int block_position(int k) {
  return kSplitsEvenOdd<T> ? (k % 2) * kLanes + k / 2 : k;
}

// Where element j of a row of `length` elements of T sits once the row is walked by
// for_each_block from its first element: whole blocks in block_position order, the tail in order.
template <typename T>
constexpr int64_t block_slot(int64_t j, int64_t length) {
  const int64_t in_block = j % kBlock;
  if (j >= length / kBlock * kBlock) return j;
  return j - in_block + block_position<T>(static_cast<int>(in_block));
}

// bf16 bits of x in the high half of each lane, rounded as f32_to_bf16x8_bits rounds.
template <NaNs kNaNs = NaNs::kAny>
QWEN4EXP_ALWAYS_INLINE u32x8 bf16_bits_high(f32x8 x) {
  const u32x8 u = as_u32(x);
  const u32x8 rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  if constexpr (kNaNs == NaNs::kLowHalfZero) return rounded;  // low half left as garbage
  return x != x ? (u | 0x00400000u) : rounded;
}

// The storage bits of x in T, one per 32-bit lane (16-bit T only).
template <typename T, NaNs kNaNs = NaNs::kAny>
QWEN4EXP_ALWAYS_INLINE u32x8 bits_u32(f32x8 x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_bits_high<kNaNs>(x) >> 16;
  } else {
    return f32_to_f16x8_bits(x);
  }
}

template <typename T>
QWEN4EXP_ALWAYS_INLINE f32x16 load_n(const T* p, Block16) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    u32x8 pairs;
    std::memcpy(&pairs, p, sizeof(pairs));
    return {as_f32(pairs << 16), as_f32(pairs & 0xFFFF0000u)};
  } else if constexpr (std::is_same_v<T, f16_t>) {
    u32x8 pairs;
    std::memcpy(&pairs, p, sizeof(pairs));
    return {f16_bits_to_f32(pairs & 0xFFFFu), f16_bits_to_f32(pairs >> 16)};
  } else {
    return {load(p), load(p + kLanes)};
  }
}
template <NaNs kNaNs = NaNs::kAny, typename T>
QWEN4EXP_ALWAYS_INLINE void store_n(T* p, f32x16 x, Block16) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const u32x8 pairs = (bf16_bits_high<kNaNs>(x.lo) >> 16) |
                        (bf16_bits_high<kNaNs>(x.hi) & 0xFFFF0000u);
    std::memcpy(p, &pairs, sizeof(pairs));
  } else if constexpr (std::is_same_v<T, f16_t>) {
    const u32x8 pairs = f32_to_f16x8_bits(x.lo) | (f32_to_f16x8_bits(x.hi) << 16);
    std::memcpy(p, &pairs, sizeof(pairs));
  } else {
    store(p, x.lo);
    store(p + kLanes, x.hi);
  }
}
template <typename T, NaNs kNaNs = NaNs::kAny>
QWEN4EXP_ALWAYS_INLINE f32x16 round(f32x16 x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return {as_f32(bf16_bits_high<kNaNs>(x.lo) & 0xFFFF0000u),
            as_f32(bf16_bits_high<kNaNs>(x.hi) & 0xFFFF0000u)};
  } else {
    return {round<T>(x.lo), round<T>(x.hi)};
  }
}

// body(i, step) over [begin, end): whole blocks (step = Block16{}) from begin, then the rest in
// load_n steps of at most kLanes (step = the count). A row's blocks must start at a multiple of
// kBlock from its first element, where block_position's layout starts.
template <typename Body>
QWEN4EXP_ALWAYS_INLINE void for_each_block(int begin, int end, const Body& body) {
  int i = begin;
  for (; i + kBlock <= end; i += kBlock) body(i, Block16{});
  for (; i < end; i += kLanes) body(i, end - i < kLanes ? end - i : kLanes);
}

// exp on eight fp32 lanes (ple_conv's fp32 SiLU, the hyper-connection sigmoids): Cephes' expf
// polynomial (~1 ulp), IEEE overflow to inf past ln(FLT_MAX); below -87 it returns exp(-87) (a
// sigmoid or SiLU only adds it to 1, where anything under 2^-24 vanishes). (Its SiLU rounded to
// bf16 or fp16 would even be exact for all 65536 inputs of either type, but the division makes it
// slower there than ple_conv's table.)
QWEN4EXP_ALWAYS_INLINE f32x8 exp_poly(f32x8 x) {
  const f32x8 lo = splat(-87.0f), hi = splat(88.72283905f);
  f32x8 c = x < lo ? lo : x;
  c = c > hi ? hi : c;
  // n = round(c·log2 e): adding and subtracting 1.5·2^23 rounds to an integer.
  const f32x8 n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  f32x8 r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x8 poly = splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * (r * r) + r + 1.0f;
  // 2^n as 2^(n-1)·2, so that n = 128 (just below ln(FLT_MAX)) overflows the way IEEE does.
  const i32x8 exponent = __builtin_convertvector(n, i32x8) + 126;
  return (poly * (f32x8)(exponent << 23)) * 2.0f;
}

#if QWEN4EXP_X86_AVX512
inline bool cpu_has_avx() {
  static const bool has = __builtin_cpu_supports("avx");
  return has;
}
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
inline bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
inline bool cpu_has_avx512f_dq() {  // ngram_ids' hash: AVX-512DQ's 64-bit multiply and masks
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has;
}
inline bool cpu_has_avx512bw_vl() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}
#endif

}  // namespace simd
}  // namespace qwen4exp
