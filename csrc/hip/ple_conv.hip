// HIP kernels for ple_conv (SPEC §6). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// One block row per logical token, each thread VEC consecutive channels: in prefill and spec 8
// (one 128-bit access per row for bf16/fp16; 4 for fp32) when the rows allow it, in decode 8
// bytes' worth, else one. A block takes exactly one row: past 65536 rows the launcher launches
// again from where the last launch stopped. (Blocks that looped over rows let the compiler hoist
// every loop-invariant uniform product — channel, tap and window strides times constants — out
// of the loop and keep them all in scalar registers, which spilled on AMD.)
//
// Decode has its own kernel: a token is a request, so its thread alone reads and shifts its
// channels of the window. It loads the whole window, with the row's other inputs, before it
// stores any of it: the shift is S independent loads, then S independent stores, not S
// load-store round trips through the memory system. An entry's channels are one access where the
// state keeps them contiguous (vLLM's window-first layout). The released model's K = 4, δ = 3 is
// compiled with constant K and δ, the window in registers; other shapes run the taps in a loop
// and move the window through registers a chunk at a time. Prefill and spec compute their
// outputs from the old state in one kernel and write the state back in a second, after every
// token has read it, one block row per request. In prefill with K = 4 and the weights as vLLM
// stores them, a token past its request's first S issues its four input rows' loads and its
// weights' at once, instead of one tap's round trip after another.
//
// The host cannot see the data, so every index taken from it is checked here: a token whose
// token_indices entry is out of range is skipped (its residual row is not written); a slot id
// outside [0, slots) is treated as the null slot (no state read or written, output 0 in decode
// and prefill); query starts that run backwards or past the batch produce no output and no
// write-back; taps whose input row falls outside the batch read 0. Nothing reads or writes out
// of bounds, whatever the indices hold.
#include <type_traits>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/ple_conv.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;
// The fewest waves per SIMD on AMD for every conv kernel: the op's floor in
// tools/kernel_report.py (FLOORS), held by register allocation (QWEN4EXP_AMD_MIN_WAVES).
constexpr int kAmdMinWaves = 7;

// This thread's first channel: block row y holds channels [y·kThreads·VEC, (y+1)·kThreads·VEC).
// The launcher refuses more than kMaxGridY block rows, so it is below 2^27, and so is its byte
// offset in a row below 2^31. Unsigned, so that a row access is a uniform base plus a
// zero-extended 32-bit offset: one VGPR on AMD (global_load's saddr form), not a VGPR pair.
template <int VEC>
QWEN4EXP_DEVICE unsigned first_channel() {
  return (blockIdx.y * kThreads + threadIdx.x) * VEC;
}

QWEN4EXP_DEVICE bool slot_in_range(const PleConvParams& p, int64_t slot) {
  return slot >= 0 && slot < p.num_slots;
}

// VEC consecutive elements exactly as stored: one element, or one 8- or 16-byte word (the
// address aligned to its size). Decode moves its window in this form, bit for bit.
template <typename T, int VEC>
using Packed =
    std::conditional_t<VEC == 1, T, std::conditional_t<VEC * sizeof(T) == 16, uint4, uint2>>;

template <typename T, int VEC>
QWEN4EXP_DEVICE Packed<T, VEC> load_packed(const T* p) {
  static_assert(VEC == 1 || VEC * sizeof(T) == 8 || VEC * sizeof(T) == 16,
                "vector accesses are 8 or 16 bytes");
  return *reinterpret_cast<const Packed<T, VEC>*>(p);
}

template <typename T, int VEC>
QWEN4EXP_DEVICE void store_packed(T* p, const Packed<T, VEC>& v) {
  *reinterpret_cast<Packed<T, VEC>*>(p) = v;
}

// A packed vector as its 32-bit words, and back.
template <typename T, int VEC>
constexpr int kWords = static_cast<int>(VEC * sizeof(T) / 4);

QWEN4EXP_DEVICE void to_words(const uint2& v, uint32_t (&w)[2]) {
  w[0] = v.x;
  w[1] = v.y;
}
QWEN4EXP_DEVICE void to_words(const uint4& v, uint32_t (&w)[4]) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
QWEN4EXP_DEVICE uint2 from_words(const uint32_t (&w)[2]) {
  uint2 v;
  v.x = w[0];
  v.y = w[1];
  return v;
}
QWEN4EXP_DEVICE uint4 from_words(const uint32_t (&w)[4]) {
  uint4 v;
  v.x = w[0];
  v.y = w[1];
  v.z = w[2];
  v.w = w[3];
  return v;
}

// base + bytes, for a uniform base and a per-lane offset.
template <typename T>
QWEN4EXP_DEVICE T* byte_offset(T* base, uint32_t bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + bytes);
}

// A packed vector's values in fp32. 16-bit elements go through block_reduce.h's widen: fp16 by the
// device's conversion instruction, exact like float_types.h's integer emulation (whose branches
// took the fp16 prefill kernel of K = 4 to 76 VGPRs on gfx942, below the occupancy floor); a
// signalling NaN comes out quiet, as it would from the arithmetic that follows.
template <typename T, int VEC>
QWEN4EXP_DEVICE void unpack_floats(const Packed<T, VEC>& v, float (&out)[VEC]) {
  if constexpr (VEC == 1) {
    out[0] = to_float(v);
  } else {
    uint32_t word[kWords<T, VEC>];
    to_words(v, word);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if constexpr (sizeof(T) == 4) {
        out[i] = bits_to_float(word[i]);
      } else {
        out[i] = widen(T{static_cast<uint16_t>(word[i / 2] >> (16 * (i % 2)))});
      }
    }
  }
}

// Each value rounded to T (to nearest even), packed. The words are assembled with shifts, not
// through a union of 16-bit elements, which hipcc built in scratch memory (block_reduce.h).
template <typename T, int VEC>
QWEN4EXP_DEVICE Packed<T, VEC> pack_floats(const float (&in)[VEC]) {
  if constexpr (VEC == 1) {
    return from_float<T>(in[0]);
  } else {
    uint32_t word[kWords<T, VEC>];
#pragma unroll
    for (int w = 0; w < kWords<T, VEC>; ++w) {
      if constexpr (sizeof(T) == 4) {
        word[w] = float_to_bits(in[w]);
      } else {
        word[w] = static_cast<uint32_t>(from_float<T>(in[2 * w]).bits) |
                  (static_cast<uint32_t>(from_float<T>(in[2 * w + 1]).bits) << 16);
      }
    }
    return from_words(word);
  }
}

template <typename T, int VEC>
QWEN4EXP_DEVICE void load_floats_at(const T* p, float (&out)[VEC]) {
  unpack_floats<T, VEC>(load_packed<T, VEC>(p), out);
}

template <typename T, int VEC>
QWEN4EXP_DEVICE Packed<T, VEC> zero_packed() {
  float zero[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) zero[v] = 0.f;
  return pack_floats<T, VEC>(zero);
}

// Weights and state entries are loaded as stored and converted where they are used, after the
// loads around them are issued: fp16's conversion branches, and where a loop converted each value
// as it loaded it, hipcc waited for every load before it issued the next.

// Tap k's weights w[c, k] of this thread's channels (`weights` points at its first channel's row).
template <typename W, int VEC>
QWEN4EXP_DEVICE void load_weights(const PleConvParams& p, const W* weights, int k, W (&w)[VEC]) {
  const W* column = weights + static_cast<int64_t>(k) * p.weight_tap_stride;
#pragma unroll
  for (int v = 0; v < VEC; ++v) w[v] = column[v * p.weight_channel_stride];
}

// acc += w · tap, channel by channel.
template <typename W, int VEC>
QWEN4EXP_DEVICE void add_tap(const W (&w)[VEC], const float (&tap)[VEC], float (&acc)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] += to_float(w[v]) * tap[v];
}

// What a row's output adds to: its residual and outer_residual entries (when there is one).
// Kept as stored, converted where they are used: a conversion inside the branch made hipcc wait
// for the loads there, before it issued any of the window's.
template <typename T, int VEC>
struct OutputAddends {
  Packed<T, VEC> residual, outer;
};

template <typename T, int VEC>
QWEN4EXP_DEVICE OutputAddends<T, VEC> load_addends(const PleConvParams& p, int64_t row,
                                                   unsigned c0) {
  OutputAddends<T, VEC> a{zero_packed<T, VEC>(), zero_packed<T, VEC>()};
  if (p.outer_residual != nullptr) {
    a.residual =
        load_packed<T, VEC>(static_cast<const T*>(p.residual) + row * p.residual_row_stride + c0);
    a.outer = load_packed<T, VEC>(static_cast<const T*>(p.outer_residual) +
                                  row * p.outer_row_stride + c0);
  }
  return a;
}

// Writes physical row `row`'s output for channels [c0, c0 + VEC): y = round(SiLU(round(acc)))
// where the token produces one, else 0, then the fused residuals. The conv sum is rounded to the
// storage dtype before SiLU (F.conv1d materialises it).
template <typename T, int VEC>
QWEN4EXP_DEVICE void store_output(const PleConvParams& p, int64_t row, unsigned c0,
                                  const float (&acc)[VEC], bool produce,
                                  const OutputAddends<T, VEC>& a) {
  float y[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float conv = round_to<T>(acc[v]);
    y[v] = produce ? round_to<T>(conv * sigmoid_f32(conv)) : 0.f;
  }
  if (p.outer_residual != nullptr) {
    float residual[VEC], outer[VEC];
    unpack_floats<T, VEC>(a.residual, residual);
    unpack_floats<T, VEC>(a.outer, outer);
#pragma unroll
    for (int v = 0; v < VEC; ++v) y[v] = outer[v] + round_to<T>(residual[v] + y[v]);
  }
  store_packed<T, VEC>(static_cast<T*>(p.residual) + row * p.residual_row_stride + c0,
                       pack_floats<T, VEC>(y));
}

// Entries the decode of a shape without its own kernel moves through registers at once.
constexpr int kWindowChunk = 8;

// Decode, token t = first + blockIdx.x (request t), for K = kK and δ = kDil, or any K and δ
// (kK = 0). VEC > 1 only where the launcher found the state's channel stride 1 and its entries
// aligned, so that an entry's VEC channels are one access.
template <typename T, typename W, int VEC, int kK, int kDil>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    ple_conv_decode_kernel(PleConvParams p, int64_t first) {
  using P = Packed<T, VEC>;
  const unsigned c0 = first_channel<VEC>();
  if (c0 >= p.channels) return;
  const int64_t t = first + blockIdx.x;
  const int64_t row = conv_physical_row(p, t);
  if (row < 0) return;
  const int64_t slot = p.state_indices[t];
  const bool live = slot != kNullSlot && slot_in_range(p, slot);
  const bool read = live && (!p.has_initial_states.present() || p.has_initial_states[t] != 0);

  const int64_t ws = p.state_window_stride;
  const P x = load_packed<T, VEC>(static_cast<const T*>(p.inputs) + row * p.inputs_row_stride + c0);
  const OutputAddends<T, VEC> addends = load_addends<T, VEC>(p, row, c0);
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;

  if constexpr (kK > 0) {
    // Everything the token reads — window, weights, its rows — is loaded before the first store,
    // in one round trip. The taps come from the window's registers; the window is stored back
    // one entry down before SiLU, so that it is not live next to SiLU's registers. Each address
    // is a uniform base plus this lane's 32-bit byte offset (the launcher checked that the
    // channels' offsets fit): with 64-bit ones, the addresses of the 16 weight loads alone held
    // 32 VGPRs on AMD.
    constexpr int kS = (kK - 1) * kDil;
    static_assert(kS > 0, "a compiled shape has a window");
    const uint32_t state_lane =
        c0 * static_cast<uint32_t>(VEC > 1 ? 1 : p.state_channel_stride) * sizeof(T);
    const uint32_t weight_lane = c0 * static_cast<uint32_t>(p.weight_channel_stride) * sizeof(W);
    T* const slot_window = static_cast<T*>(p.conv_state) + (live ? slot : 0) * p.state_slot_stride;
    const auto entry = [&](int i) { return byte_offset(slot_window + i * ws, state_lane); };
    P old[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i)
      old[i] = read ? load_packed<T, VEC>(entry(i)) : zero_packed<T, VEC>();
    W w[kK][VEC];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        w[k][v] = *byte_offset(static_cast<const W*>(p.weights) + k * p.weight_tap_stride +
                                   v * p.weight_channel_stride,
                               weight_lane);
      }
    }
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      float tap[VEC];
      unpack_floats<T, VEC>(k * kDil < kS ? old[k * kDil] : x, tap);
      add_tap<W, VEC>(w[k], tap, acc);
    }
    if (live) {
#pragma unroll
      for (int i = 0; i + 1 < kS; ++i) store_packed<T, VEC>(entry(i), old[i + 1]);
      store_packed<T, VEC>(entry(kS - 1), x);
    }
    store_output<T, VEC>(p, row, c0, acc, live, addends);
  } else {
    // This thread's channels of the slot's window: entry i at window + i·ws.
    T* const window = static_cast<T*>(p.conv_state) + (live ? slot : 0) * p.state_slot_stride +
                      static_cast<int64_t>(c0) * (VEC > 1 ? 1 : p.state_channel_stride);
    const W* const weights =
        static_cast<const W*>(p.weights) + static_cast<int64_t>(c0) * p.weight_channel_stride;
    const int S = p.state_len;
    for (int k = 0; k < p.kernel_size; ++k) {
      const int h = k * p.dilation;  // < S but for the last tap, which is x
      W w[VEC];
      load_weights<W, VEC>(p, weights, k, w);
      float tap[VEC];
      unpack_floats<T, VEC>(
          h < S ? (read ? load_packed<T, VEC>(window + h * ws) : zero_packed<T, VEC>()) : x, tap);
      add_tap<W, VEC>(w, tap, acc);
    }
    store_output<T, VEC>(p, row, c0, acc, live, addends);
    if (live && S > 0) {
      // Entries [0, S) become old[1:S] ++ x (zeros ++ x without an initial state), a chunk at a
      // time in ascending order, each loaded whole before any of it is stored: a chunk writes
      // only entries that it or an earlier chunk has read.
      for (int base = 0; base + 1 < S; base += kWindowChunk) {
        P moved[kWindowChunk];
#pragma unroll
        for (int n = 0; n < kWindowChunk; ++n) {
          moved[n] = read && base + n + 1 < S ? load_packed<T, VEC>(window + (base + n + 1) * ws)
                                              : zero_packed<T, VEC>();
        }
#pragma unroll
        for (int n = 0; n < kWindowChunk; ++n) {
          if (base + n + 1 < S) store_packed<T, VEC>(window + (base + n) * ws, moved[n]);
        }
      }
      store_packed<T, VEC>(window + (S - 1) * ws, x);
    }
  }
}

// The physical input row at history position h >= S of the request whose chunk starts at logical
// row `start`, or -1 where that row is outside the batch (its tap reads 0).
QWEN4EXP_DEVICE int64_t chunk_input_row(const PleConvParams& p, int64_t start, int64_t h, int S) {
  const int64_t logical = start + h - S;
  return logical >= 0 && logical < p.num_rows ? conv_physical_row(p, logical) : int64_t{-1};
}

// The released model's kernel size and dilation. Decode gets kernels of their own for the pair;
// the prefill outputs kernel is also compiled with the kernel size constant (kK), for weights in
// the activations' dtype stored [C, K] (what vLLM passes), where a thread's VEC channels' weights
// are one run of VEC·K values: 64 bytes, four 128-bit loads (weights_packed).
constexpr int kModelKernel = 4;
constexpr int kModelDilation = 3;

// Tap k's weight of channel c0 + v from a thread's packed run of VEC·kK weights (as 32-bit
// words: channel-major, tap-minor), widened as unpack_floats does.
template <typename T, int VEC, int kK>
QWEN4EXP_DEVICE float packed_weight(const uint32_t (&words)[VEC * kK * sizeof(T) / 4], int v,
                                    int k) {
  const int e = v * kK + k;
  if constexpr (sizeof(T) == 4) {
    return bits_to_float(words[e]);
  } else {
    return widen(T{static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)))});
  }
}

// Prefill and spec outputs, logical row t = first + blockIdx.x, from the old state. kK = 0: any
// kernel size and weight layout, the taps one at a time. kK > 0 (prefill, weights_packed): a
// token whose taps are all rows of its request's chunk (j >= S: every token but a request's
// first S) loads the kK rows and its weights at once, then sums them. (Spec chunks are shorter
// than S.)
template <typename T, typename W, int VEC, ConvMode kMode, int kK>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    ple_conv_outputs_kernel(PleConvParams p, int64_t first) {
  static_assert(kMode != ConvMode::kDecode, "decode has its own kernel");
  static_assert(kK == 0 || (std::is_same_v<T, W> && VEC > 1), "kK > 0 reads packed weights");
  const unsigned c0 = first_channel<VEC>();
  if (c0 >= p.channels) return;
  const int64_t t = first + blockIdx.x;
  const int64_t row = conv_physical_row(p, t);
  if (row < 0) return;

  bool produce = false, read = false;
  int64_t slot = kNullSlot, start = t, offset = 0;
  if (p.num_requests > 0) {
    const IndexView& qsl = p.query_start_loc;
    const int64_t r = find_request(qsl, p.num_requests, t);
    start = qsl[r];
    const bool in_range = t >= start && t < qsl[p.num_requests];
    slot = p.state_indices[r];
    const bool live = slot != kNullSlot && slot_in_range(p, slot);
    if constexpr (kMode == ConvMode::kSpec) {
      read = live;
      produce = in_range;
      offset = conv_spec_offset(p, r);
    } else {
      read = live && p.has_initial_states[r] != 0;
      produce = in_range && live;
    }
  }

  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  const int64_t j = t - start;
  const int S = p.state_len;
  bool summed = false;
  if constexpr (kK > 0) {
    if (produce && j >= S) {
      constexpr int kWeightWords = VEC * kK * sizeof(T) / 4;
      Packed<T, VEC> rows[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const int64_t src = chunk_input_row(p, start, j + static_cast<int64_t>(k) * p.dilation, S);
        rows[k] = src >= 0 ? load_packed<T, VEC>(static_cast<const T*>(p.inputs) +
                                                 src * p.inputs_row_stride + c0)
                           : zero_packed<T, VEC>();
      }
      uint32_t words[kWeightWords];
      const uint4* weights =
          reinterpret_cast<const uint4*>(static_cast<const T*>(p.weights) + c0 * kK);
#pragma unroll
      for (int i = 0; i < kWeightWords / 4; ++i) {
        const uint4 w = weights[i];
        words[4 * i] = w.x;
        words[4 * i + 1] = w.y;
        words[4 * i + 2] = w.z;
        words[4 * i + 3] = w.w;
      }
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        float tap[VEC];
        unpack_floats<T, VEC>(rows[k], tap);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] += packed_weight<T, VEC, kK>(words, v, k) * tap[v];
      }
      summed = true;
    }
  }
  if (produce && !summed) {
    const W* weights =
        static_cast<const W*>(p.weights) + static_cast<int64_t>(c0) * p.weight_channel_stride;
    // This thread's first channel of the slot's window, from the read offset.
    const T* window =
        static_cast<const T*>(p.conv_state) + (read ? slot : 0) * p.state_slot_stride +
        static_cast<int64_t>(c0) * p.state_channel_stride + offset * p.state_window_stride;
    // One tap at a time: nvcc unrolled this loop into 77 registers at VEC = 1.
#pragma unroll 1
    for (int k = 0; k < p.kernel_size; ++k) {
      const int64_t h = j + static_cast<int64_t>(k) * p.dilation;
      W w[VEC];
      load_weights<W, VEC>(p, weights, k, w);
      float tap[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) tap[v] = 0.f;
      if (h < S) {
        if (read) {
          const T* entry = window + h * p.state_window_stride;
          T stored[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) stored[v] = entry[v * p.state_channel_stride];
#pragma unroll
          for (int v = 0; v < VEC; ++v) tap[v] = to_float(stored[v]);
        }
      } else {
        const int64_t src = chunk_input_row(p, start, h, S);
        if (src >= 0) {
          load_floats_at<T, VEC>(static_cast<const T*>(p.inputs) + src * p.inputs_row_stride + c0,
                                 tap);
        }
      }
      add_tap<W, VEC>(w, tap, acc);
    }
  }
  store_output<T, VEC>(p, row, c0, acc, produce, load_addends<T, VEC>(p, row, c0));
}

// Entries the write-back moves through registers at once.
constexpr int kWriteBackChunk = 4;

// Request r = first + blockIdx.x's new state, channel first_channel<1>(): one channel per thread,
// as the state is read and written element by element, and a request's few entries want more
// threads rather than wider ones. The entries go through registers a chunk at a time, each chunk
// loaded whole before any of it is stored, and are copied bit for bit.
template <typename T, ConvMode kMode>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    ple_conv_write_back_kernel(PleConvParams p, int64_t first) {
  const unsigned c = first_channel<1>();
  if (c >= p.channels) return;
  const int64_t r = first + blockIdx.x;
  const int64_t slot = p.state_indices[r];
  if (slot == kNullSlot || !slot_in_range(p, slot)) return;
  const int64_t start = p.query_start_loc[r];
  const int64_t end = p.query_start_loc[r + 1];
  if (start < 0 || end < start || end > p.num_rows) return;
  const int S = p.state_len;
  const int64_t qlen = end - start;
  int64_t shift, offset = 0, count;
  bool init = true;
  if constexpr (kMode == ConvMode::kSpec) {
    // Entries [0, S-1+qlen) become old[o+1 : o+S] ++ chunk; the unused tail is kept.
    shift = 1;
    offset = conv_spec_offset(p, r);
    count = S - 1 + qlen;
    if (count > S + p.query_len - 1) count = S + p.query_len - 1;
  } else {
    if (qlen <= 0) return;  // an empty request keeps its state
    shift = qlen;
    count = S;
    init = p.has_initial_states[r] != 0;
  }
  T* window = static_cast<T*>(p.conv_state) + slot * p.state_slot_stride +
              static_cast<int64_t>(c) * p.state_channel_stride;
  const int64_t ws = p.state_window_stride;
  // Entry i becomes entry i + offset + shift of the old window (zero without an initial state)
  // while that is one of its S entries, then row start + shift + i - S of the chunk. The old
  // window moves down in ascending chunks: a chunk writes only entries below those that it and
  // later chunks read.
  int64_t kept = S - shift;
  kept = kept < 0 ? 0 : (kept > count ? count : kept);
  const T* old = window + (offset + shift) * ws;
  for (int64_t base = 0; base < kept; base += kWriteBackChunk) {
    T moved[kWriteBackChunk];
#pragma unroll
    for (int n = 0; n < kWriteBackChunk; ++n) {
      moved[n] = init && base + n < kept ? old[(base + n) * ws] : from_float<T>(0.0f);
    }
#pragma unroll
    for (int n = 0; n < kWriteBackChunk; ++n) {
      if (base + n < kept) window[(base + n) * ws] = moved[n];
    }
  }
  const T* inputs = static_cast<const T*>(p.inputs) + c;
  for (int64_t base = kept; base < count; base += kWriteBackChunk) {
    int64_t src[kWriteBackChunk];
#pragma unroll
    for (int n = 0; n < kWriteBackChunk; ++n) {
      src[n] = base + n < count ? conv_physical_row(p, start + shift + base + n - S) : int64_t{-1};
    }
    T value[kWriteBackChunk];
#pragma unroll
    for (int n = 0; n < kWriteBackChunk; ++n) {
      value[n] = src[n] >= 0 ? inputs[src[n] * p.inputs_row_stride] : from_float<T>(0.0f);
    }
#pragma unroll
    for (int n = 0; n < kWriteBackChunk; ++n) {
      if (src[n] >= 0) window[(base + n) * ws] = value[n];
    }
  }
}

// Launches `kernel` over `count` rows (or requests) in launches of at most kMaxGridX block rows,
// each told the first row it takes.
template <typename Kernel>
hipError_t launch_rows(Kernel kernel, int64_t count, int64_t channel_blocks, const PleConvParams& p,
                       hipStream_t stream) {
  for (int64_t first = 0; first < count; first += kMaxGridX) {
    const int64_t rows = count - first < kMaxGridX ? count - first : kMaxGridX;
    const hipError_t status = launch_kernel(
        kernel, dim3(static_cast<unsigned>(rows), static_cast<unsigned>(channel_blocks)), kThreads,
        0, stream, p, first);
    if (status != hipSuccess) return status;
  }
  return hipSuccess;
}

// Block rows that cover the channels at VEC per thread, or -1 past kMaxGridY (more than
// 65535 · 256 · VEC channels, 16.7 million at VEC = 1, are not launched).
template <int VEC>
int64_t channel_blocks(const PleConvParams& p) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * VEC;
  const int64_t blocks = (p.channels + per_block - 1) / per_block;
  return blocks > kMaxGridY ? -1 : blocks;
}

// True when an address or byte stride is a multiple of `bytes` (8 or 16).
bool aligned_to(uint64_t value, uint64_t bytes) { return value % bytes == 0; }

// Whether the prefill outputs kernel compiled for kModelKernel can read the weights (see there).
template <typename T, int VEC>
bool weights_packed(const PleConvParams& p) {
  static_assert(VEC * kModelKernel * sizeof(T) % 16 == 0, "whole 128-bit loads");
  return p.kernel_size == kModelKernel && p.weight_dtype == p.dtype && p.weight_tap_stride == 1 &&
         p.weight_channel_stride == kModelKernel &&
         aligned_to(reinterpret_cast<uint64_t>(p.weights), 16);
}

// The rows (inputs, residual, outer_residual) as VEC-channel words of VEC·sizeof(T) bytes.
template <typename T, int VEC>
bool rows_packed(const PleConvParams& p) {
  constexpr uint64_t kBytes = VEC * sizeof(T);
  return p.channels % VEC == 0 && aligned_to(reinterpret_cast<uint64_t>(p.inputs), kBytes) &&
         aligned_to(reinterpret_cast<uint64_t>(p.residual), kBytes) &&
         aligned_to(reinterpret_cast<uint64_t>(p.outer_residual), kBytes) &&
         aligned_to(p.inputs_row_stride * sizeof(T), kBytes) &&
         aligned_to(p.residual_row_stride * sizeof(T), kBytes) &&
         aligned_to(p.outer_row_stride * sizeof(T), kBytes);
}

template <typename T, typename W, int VEC>
hipError_t launch_decode(const PleConvParams& p, hipStream_t stream) {
  const int64_t blocks = channel_blocks<VEC>(p);
  if (blocks < 0) return hipErrorInvalidValue;
  // The compiled shape addresses a lane's channels of the state and the weights with 32-bit byte
  // offsets (a lane's first channel is at most the last one).
  const uint64_t last = static_cast<uint64_t>(p.channels - 1);
  const bool offsets_fit =
      (VEC > 1 || last * static_cast<uint64_t>(p.state_channel_stride) * sizeof(T) <= UINT32_MAX) &&
      last * static_cast<uint64_t>(p.weight_channel_stride) * sizeof(W) <= UINT32_MAX;
  return p.kernel_size == kModelKernel && p.dilation == kModelDilation && offsets_fit
             ? launch_rows(ple_conv_decode_kernel<T, W, VEC, kModelKernel, kModelDilation>,
                           p.num_rows, blocks, p, stream)
             : launch_rows(ple_conv_decode_kernel<T, W, VEC, 0, 0>, p.num_rows, blocks, p, stream);
}

// Prefill and spec: the outputs, then the write-back (each mode its own kernels: a kernel with
// both keeps both modes' values live).
template <typename T, typename W, int VEC, ConvMode kMode>
hipError_t launch_chunks(const PleConvParams& p, hipStream_t stream) {
  const int64_t blocks = channel_blocks<VEC>(p), write_back_blocks = channel_blocks<1>(p);
  if (blocks < 0 || write_back_blocks < 0) return hipErrorInvalidValue;
  auto outputs = ple_conv_outputs_kernel<T, W, VEC, kMode, 0>;
  if constexpr (VEC > 1 && std::is_same_v<T, W> && kMode == ConvMode::kPrefill) {
    if (weights_packed<T, VEC>(p))
      outputs = ple_conv_outputs_kernel<T, W, VEC, kMode, kModelKernel>;
  }
  const hipError_t status = launch_rows(outputs, p.num_rows, blocks, p, stream);
  if (status != hipSuccess) return status;
  return launch_rows(ple_conv_write_back_kernel<T, kMode>, p.num_requests, write_back_blocks, p,
                     stream);
}

template <typename T, typename W>
hipError_t launch_typed(const PleConvParams& p, hipStream_t stream) {
  if (p.mode == ConvMode::kDecode) {
    // 8 bytes per access (4 channels of bf16/fp16, 2 of fp32): with 16, a thread's window,
    // weights and output kept 80 registers live on sm_90 (24 warps per SM, below the floor), and
    // decode's few tokens want more blocks rather than wider threads. The window is one word per
    // entry where the state keeps channels contiguous and aligned (vLLM's window-first layout).
    constexpr int kVec = 8 / sizeof(T);
    const bool packed = rows_packed<T, kVec>(p) && p.state_channel_stride == 1 &&
                        aligned_to(reinterpret_cast<uint64_t>(p.conv_state), 8) &&
                        aligned_to(p.state_slot_stride * sizeof(T), 8) &&
                        aligned_to(p.state_window_stride * sizeof(T), 8);
    return packed ? launch_decode<T, W, kVec>(p, stream) : launch_decode<T, W, 1>(p, stream);
  }
  // One 128-bit access per row and thread (8 channels of bf16/fp16, 4 of fp32).
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = rows_packed<T, kVec>(p);
  if (p.mode == ConvMode::kPrefill) {
    return packed ? launch_chunks<T, W, kVec, ConvMode::kPrefill>(p, stream)
                  : launch_chunks<T, W, 1, ConvMode::kPrefill>(p, stream);
  }
  return packed ? launch_chunks<T, W, kVec, ConvMode::kSpec>(p, stream)
                : launch_chunks<T, W, 1, ConvMode::kSpec>(p, stream);
}

}  // namespace

hipError_t launch_ple_conv(const PleConvParams& p, hipStream_t stream) {
  if (p.channels == 0)
    return hipSuccess;  // nothing to compute or keep (a GPU refuses an empty grid)
  return dispatch_dtype(
      kFloatDtypes, p.dtype,
      [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        // The weights are fp32 or the activations' own dtype.
        return p.weight_dtype == Dtype::kF32 ? launch_typed<T, float>(p, stream)
                                             : launch_typed<T, T>(p, stream);
      },
      [] { return hipErrorInvalidValue; });
}

}  // namespace qwen4exp
