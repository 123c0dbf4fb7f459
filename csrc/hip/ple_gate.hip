// HIP kernel for ple_gate (SPEC §5). Compiled by hipcc for AMD and by nvcc (through
// platform.h) for NVIDIA.
//
// The work is per (token, stream), as in vLLM's kernel: a group of 2^group_log2 threads takes one
// (token, stream), the smallest power of two that holds the stream's key, hidden and value rows
// in registers at kSlots 16-byte chunks per lane (8 bf16/fp16 or 4 fp32), at most the whole block
// (H = 2560 in bf16: 256 threads, two chunks a lane; H = 100: 8 threads, a wave takes 4 or 8). Each
// lane loads its chunks of the three rows at once, one 128-bit access per chunk when the rows allow
// it and element by element otherwise, and every later step works from those registers: the rows
// are read from memory once. Rows too long for the block's registers are taken in tiles, each step
// reading them again. The sums are group sums (block_reduce.h): wave shuffles, and shared memory
// only where a group spans waves. Which elements a lane sums, and in what order, depends on H
// alone, so the results depend neither on how the rows are aligned nor on T. Per (token, stream):
// - "vllm" rounding: Σk², Σq² (one group sum); Σ round(round(k·r_k·(1+w_k))·round(q·r_q·
//   (1+w_q))) (a second); g; Σ round(g·v)² (a third); then the two outputs. The rounding points
//   are vLLM's; the summation order is a tree, not numpy's, so bf16/fp16 results can differ from
//   the CPU kernel by one unit in the last place where a sum lands next to a rounding boundary
//   (the tolerance tests/ple_gate/ states for every backend).
// - "fp32" rounding: Σk², Σq², Σk·q·(1+w_k)(1+w_q), Σv² in one group sum, then the outputs.
// Roundings to bf16/fp16 use the conversion instructions where the device has them
// (block_reduce.h: the emulation's bits).
#include <algorithm>

#include "block_reduce.h"
#include "../common/dispatch.h"
#include "../common/ple_gate.h"

namespace qwen4exp {
namespace {

constexpr int kThreads = 256;
// The fewest waves per SIMD on AMD: the op's floor in tools/kernel_report.py (FLOORS), held by
// register allocation (QWEN4EXP_AMD_MIN_WAVES).
constexpr int kAmdMinWaves = 4;
constexpr int kSlots = 2;  // 16-byte chunks of each row a lane holds per tile

// log2 of the threads per (token, stream) for rows of `chunks` 16-byte chunks.
QWEN4EXP_HD int group_log2_for(int chunks) {
  int log2 = 0;
  while ((kSlots << log2) < chunks && (2 << log2) <= kThreads) ++log2;
  return log2;
}

// The raw bits of one 16-byte chunk of a row (VEC elements of T).
struct Chunk {
  uint32_t word[4];
};

template <typename T>
QWEN4EXP_DEVICE uint32_t bits_of(T x) {
  if constexpr (sizeof(T) == 4) {
    return float_to_bits(x);
  } else {
    return x.bits;
  }
}

// Element i of a zero-initialised chunk set to the bits of a T.
template <typename T>
QWEN4EXP_DEVICE void set_element(Chunk& chunk, int i, uint32_t bits) {
  if constexpr (sizeof(T) == 4) {
    chunk.word[i] = bits;
  } else {
    chunk.word[i / 2] |= bits << (16 * (i % 2));
  }
}

// Chunk c of a row of H elements, all zero bits (+0) where c is not the lane's (c >= chunks) and
// for the elements past H (which leaves every sum as it is: the sums start at +0). kWhole: H is a
// multiple of VEC and the rows are 16-byte aligned, so a chunk is one 128-bit access.
template <typename T, bool kWhole>
QWEN4EXP_DEVICE Chunk load_chunk(const T* row, int c, int chunks, int H) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  Chunk out{};
  if (c >= chunks) return out;
  if constexpr (kWhole) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + c * VEC);
    out.word[0] = raw.x;
    out.word[1] = raw.y;
    out.word[2] = raw.z;
    out.word[3] = raw.w;
  } else {
    // Element by element from one address, the offsets immediates. Only a row's last chunk can
    // end past H: the others load every element without a test (one branch per chunk, not per
    // element; per-element tests and addresses took the AMD kernels to 140-170 VGPRs).
    const T* src = row + c * VEC;
    const int n = H - c * VEC;
    if (n >= VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) set_element<T>(out, i, bits_of(src[i]));
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) set_element<T>(out, i, i < n ? bits_of(src[i]) : 0u);
    }
  }
  return out;
}

// The lane's kSlots chunks of a tile of a row: chunks first, first + stride, ...
template <typename T, bool kWhole>
QWEN4EXP_DEVICE void load_tile(const T* row, int first, int stride, int chunks, int H,
                               Chunk (&out)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    out[s] = load_chunk<T, kWhole>(row, first + s * stride, chunks, H);
}

// Element i of a chunk, in fp32.
template <typename T>
QWEN4EXP_DEVICE float element(const Chunk& chunk, int i) {
  if constexpr (sizeof(T) == 4) {
    return bits_to_float(chunk.word[i]);
  } else {
    return widen(T{static_cast<uint16_t>(chunk.word[i / 2] >> (16 * (i % 2)))});
  }
}

// Stores VEC values rounded to T as chunk c (nothing where c >= chunks, nor past H).
template <typename T, bool kWhole, int VEC>
QWEN4EXP_DEVICE void store_chunk(T* row, int c, int chunks, int H, const float (&in)[VEC]) {
  if (c >= chunks) return;
  if constexpr (kWhole) {
    uint32_t word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (sizeof(T) == 4) {
        word[w] = float_to_bits(in[w]);
      } else {
        word[w] = static_cast<uint32_t>(narrow<T>(in[2 * w]).bits) |
                  (static_cast<uint32_t>(narrow<T>(in[2 * w + 1]).bits) << 16);
      }
    }
    uint4 raw;
    raw.x = word[0];
    raw.y = word[1];
    raw.z = word[2];
    raw.w = word[3];
    *reinterpret_cast<uint4*>(row + c * VEC) = raw;
  } else {
    T* dst = row + c * VEC;  // as load_chunk: one address, one test unless the chunk ends past H
    const int n = H - c * VEC;
    if (n >= VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) dst[i] = narrow<T>(in[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (i < n) dst[i] = narrow<T>(in[i]);
      }
    }
  }
}

// The norm weights of one chunk of T. 16-bit weights (then W is T) stay one packed chunk until
// used, half the registers of their fp32 values; fp32 weights are kept as 1 + w.
template <typename T, typename W, bool kPacked = sizeof(W) == 2>
struct ChunkWeights {
  Chunk raw;  // zero bits where load_chunk reads none: w = 0, 1 + w = 1 where the row is 0

  QWEN4EXP_DEVICE float one_plus(int i) const { return 1.0f + element<W>(raw, i); }
};

template <typename T, typename W>
struct ChunkWeights<T, W, false> {
  float value[16 / sizeof(T)];  // 1 past H and where the chunk is not the lane's

  QWEN4EXP_DEVICE float one_plus(int i) const { return value[i]; }
};

// The weights of chunk c of a stream (kWhole: the weights are 16-byte aligned too, and a chunk's
// weights are one or two 128-bit loads).
template <typename T, typename W, bool kWhole>
QWEN4EXP_DEVICE ChunkWeights<T, W> load_weights(const W* w, int c, int chunks, int H) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  ChunkWeights<T, W> out;
  if constexpr (sizeof(W) == 2) {
    out.raw = load_chunk<W, kWhole>(w, c, chunks, H);
  } else if (c >= chunks) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.value[i] = 1.0f;
  } else if constexpr (kWhole) {
#pragma unroll
    for (int l = 0; l < VEC / 4; ++l) {
      const uint4 raw = *reinterpret_cast<const uint4*>(w + c * VEC + l * 4);
      const Chunk chunk{{raw.x, raw.y, raw.z, raw.w}};
#pragma unroll
      for (int i = 0; i < 4; ++i) out.value[l * 4 + i] = 1.0f + element<W>(chunk, i);
    }
  } else if constexpr (VEC == 8) {
    // fp32 weights of 16-bit rows, eight a chunk: as load_chunk, one address and one test unless
    // the chunk ends past H (per-element tests took these kernels past 128 VGPRs on gfx942). Four
    // a chunk (fp32 rows) stay tested one by one, which hipcc (ROCm 5.2) keeps in fewer registers.
    const W* src = w + c * VEC;
    const int n = H - c * VEC;
    if (n >= VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out.value[i] = 1.0f + widen(src[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out.value[i] = i < n ? 1.0f + widen(src[i]) : 1.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      out.value[i] = c * VEC + i < H ? 1.0f + widen(w[c * VEC + i]) : 1.0f;
    }
  }
  return out;
}

QWEN4EXP_DEVICE float gate_of(float d, float magnitude) {
  const float sign = d < 0.f ? -1.0f : (d > 0.f ? 1.0f : 0.0f);
  return sigmoid_f32(sign * magnitude);
}

// One (token, stream) per group of 2^group_log2 threads; at most kMaxGridX blocks.
template <typename T, typename W, bool kWhole, bool kVllm>
__global__ void __launch_bounds__(kThreads) QWEN4EXP_AMD_MIN_WAVES(kAmdMinWaves)
    ple_gate_kernel(PleGateParams p, int group_log2) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int kWaves = kThreads / kWaveSize;
  QWEN4EXP_SHARED(float[4 * kWaves], scratch);
  const int H = p.width;
  const float h_f = static_cast<float>(H);
  const float sqrt_h = sqrtf(h_f);
  const int chunks = (H + VEC - 1) / VEC;
  const int group_size = 1 << group_log2;
  const int lane = static_cast<int>(threadIdx.x) & (group_size - 1);
  const uint32_t groups = kThreads >> group_log2;
  const int tile_chunks = kSlots << group_log2;
  const int tiles = (chunks + tile_chunks - 1) / tile_chunks;
  const bool resident = tiles == 1;  // every later step reads the rows from registers
  const uint32_t streams = static_cast<uint32_t>(p.streams);
  const uint32_t item = blockIdx.x * groups + (threadIdx.x >> group_log2);
  // A group past the last (token, stream) runs along with no chunks, for the barriers of the
  // group sums.
  const int live_chunks = item < static_cast<uint32_t>(p.num_tokens) * streams ? chunks : 0;
  const uint32_t t = item / streams;
  const int64_t base = static_cast<int64_t>(item - t * streams) * H;
  const T* key = static_cast<const T*>(p.key) + t * p.key_row_stride + base;
  const T* hidden = static_cast<const T*>(p.hidden) + t * p.hidden_row_stride + base;
  const T* value = static_cast<const T*>(p.value) + t * p.value_row_stride;
  T* gated = static_cast<T*>(p.gated) + t * p.gated_row_stride + base;
  T* conv = static_cast<T*>(p.conv_input) + t * p.conv_input_row_stride + base;
  const W* w_key = static_cast<const W*>(p.norm_key_w) + base;
  const W* w_query = static_cast<const W*>(p.norm_query_w) + base;
  const W* w_conv = static_cast<const W*>(p.norm_conv_w) + base;

  // Slot s of tile r is chunk (r · kSlots + s) · group_size + lane.
  Chunk k[kSlots], q[kSlots], v[kSlots];

  if constexpr (kVllm) {
    float sums[2] = {0.f, 0.f};
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      load_tile<T, kWhole>(key, first_chunk, group_size, live_chunks, H, k);
      load_tile<T, kWhole>(hidden, first_chunk, group_size, live_chunks, H, q);
      if (resident) load_tile<T, kWhole>(value, first_chunk, group_size, live_chunks, H, v);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float kf = element<T>(k[s], i);
          const float qf = element<T>(q[s], i);
          sums[0] += kf * kf;
          sums[1] += qf * qf;
        }
      }
    }
    group_sum<2, kThreads>(sums, group_log2, scratch);
    const float rk = 1.0f / sqrtf(sums[0] / h_f + p.eps);
    const float rq = 1.0f / sqrtf(sums[1] / h_f + p.eps);
    float dot[1] = {0.f};
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      if (!resident) {
        load_tile<T, kWhole>(key, first_chunk, group_size, live_chunks, H, k);
        load_tile<T, kWhole>(hidden, first_chunk, group_size, live_chunks, H, q);
      }
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int c = first_chunk + s * group_size;
        const auto wk = load_weights<T, W, kWhole>(w_key, c, live_chunks, H);
        const auto wq = load_weights<T, W, kWhole>(w_query, c, live_chunks, H);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float kn = round_through<T>(element<T>(k[s], i) * rk * wk.one_plus(i));
          const float qn = round_through<T>(element<T>(q[s], i) * rq * wq.one_plus(i));
          dot[0] += round_through<T>(kn * qn);
        }
      }
    }
    group_sum<1, kThreads>(dot, group_log2, scratch);
    const float d = round_through<T>(round_through<T>(dot[0]) / sqrt_h);
    const float magnitude = round_through<T>(sqrtf(gate_magnitude_floor(d)));
    const float g = round_through<T>(gate_of(d, magnitude));
    float sum_gg[1] = {0.f};
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      if (!resident) load_tile<T, kWhole>(value, first_chunk, group_size, live_chunks, H, v);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          out[i] = round_through<T>(g * element<T>(v[s], i));
          sum_gg[0] += out[i] * out[i];
        }
        store_chunk<T, kWhole>(gated, first_chunk + s * group_size, live_chunks, H, out);
      }
    }
    group_sum<1, kThreads>(sum_gg, group_log2, scratch);
    const float rg = 1.0f / sqrtf(sum_gg[0] / h_f + p.eps);
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      if (!resident) load_tile<T, kWhole>(value, first_chunk, group_size, live_chunks, H, v);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int c = first_chunk + s * group_size;
        const auto wc = load_weights<T, W, kWhole>(w_conv, c, live_chunks, H);
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          out[i] = round_through<T>(g * element<T>(v[s], i)) * rg * wc.one_plus(i);
        }
        store_chunk<T, kWhole>(conv, c, live_chunks, H, out);
      }
    }
  } else {
    float sums[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      load_tile<T, kWhole>(key, first_chunk, group_size, live_chunks, H, k);
      load_tile<T, kWhole>(hidden, first_chunk, group_size, live_chunks, H, q);
      load_tile<T, kWhole>(value, first_chunk, group_size, live_chunks, H, v);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int c = first_chunk + s * group_size;
        const auto wk = load_weights<T, W, kWhole>(w_key, c, live_chunks, H);
        const auto wq = load_weights<T, W, kWhole>(w_query, c, live_chunks, H);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float kf = element<T>(k[s], i);
          const float qf = element<T>(q[s], i);
          const float vf = element<T>(v[s], i);
          const float fused = wk.one_plus(i) * wq.one_plus(i);
          sums[0] += kf * kf;
          sums[1] += qf * qf;
          sums[2] += kf * qf * fused;
          sums[3] += vf * vf;
        }
      }
    }
    group_sum<4, kThreads>(sums, group_log2, scratch);
    const float rk = 1.0f / sqrtf(sums[0] / h_f + p.eps);
    const float rq = 1.0f / sqrtf(sums[1] / h_f + p.eps);
    const float d = sums[2] * rk * rq / sqrt_h;
    const float g = gate_of(d, sqrtf(gate_magnitude_floor(d)));
    const float g_rg = g / sqrtf(g * g * sums[3] / h_f + p.eps);
    for (int r = 0; r < tiles; ++r) {
      const int first_chunk = r * tile_chunks + lane;
      if (!resident) load_tile<T, kWhole>(value, first_chunk, group_size, live_chunks, H, v);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int c = first_chunk + s * group_size;
        const auto wc = load_weights<T, W, kWhole>(w_conv, c, live_chunks, H);
        float out_g[VEC], out_c[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float vf = element<T>(v[s], i);
          out_g[i] = g * vf;
          out_c[i] = g_rg * vf * wc.one_plus(i);
        }
        store_chunk<T, kWhole>(gated, c, live_chunks, H, out_g);
        store_chunk<T, kWhole>(conv, c, live_chunks, H, out_c);
      }
    }
  }
}

template <typename T, typename W>
hipError_t launch_typed(const PleGateParams& p, hipStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const auto aligned = [](const void* ptr) { return aligned16(reinterpret_cast<uint64_t>(ptr)); };
  const bool whole =
      p.width % kVec == 0 && aligned(p.key) && aligned(p.value) && aligned(p.hidden) &&
      aligned(p.gated) && aligned(p.conv_input) && aligned(p.norm_key_w) &&
      aligned(p.norm_query_w) && aligned(p.norm_conv_w) &&
      aligned16(p.key_row_stride * sizeof(T)) && aligned16(p.value_row_stride * sizeof(T)) &&
      aligned16(p.hidden_row_stride * sizeof(T)) && aligned16(p.gated_row_stride * sizeof(T)) &&
      aligned16(p.conv_input_row_stride * sizeof(T));
  const bool vllm = p.rounding == GateRounding::kVllm;
  const auto kernel =
      whole ? (vllm ? ple_gate_kernel<T, W, true, true> : ple_gate_kernel<T, W, true, false>)
            : (vllm ? ple_gate_kernel<T, W, false, true> : ple_gate_kernel<T, W, false, false>);
  const int group_log2 = group_log2_for((p.width + kVec - 1) / kVec);
  // One (token, stream) per group and no grid-stride loop (whose loop-invariant constants, the
  // fp64 exp's among them, the compilers kept in registers for the whole kernel): a launch takes
  // at most kMaxGridX blocks' worth, whole tokens where M allows, else a range of streams of one
  // token, its views shifted to the first of them.
  const int64_t per_launch = kMaxGridX * (kThreads >> group_log2);
  const int64_t streams_per_launch = p.streams < per_launch ? p.streams : per_launch;
  const int64_t tokens_per_launch = p.streams < per_launch ? per_launch / p.streams : 1;
  for (int64_t t0 = 0; t0 < p.num_tokens; t0 += tokens_per_launch) {
    for (int64_t m0 = 0; m0 < p.streams; m0 += streams_per_launch) {
      PleGateParams part = p;
      part.num_tokens = std::min(tokens_per_launch, p.num_tokens - t0);
      part.streams = static_cast<int32_t>(std::min(streams_per_launch, p.streams - m0));
      const int64_t channel = m0 * p.width;
      part.key = static_cast<const T*>(p.key) + t0 * p.key_row_stride + channel;
      part.value = static_cast<const T*>(p.value) + t0 * p.value_row_stride;
      part.hidden = static_cast<const T*>(p.hidden) + t0 * p.hidden_row_stride + channel;
      part.gated = static_cast<T*>(p.gated) + t0 * p.gated_row_stride + channel;
      part.conv_input = static_cast<T*>(p.conv_input) + t0 * p.conv_input_row_stride + channel;
      part.norm_key_w = static_cast<const W*>(p.norm_key_w) + channel;
      part.norm_query_w = static_cast<const W*>(p.norm_query_w) + channel;
      part.norm_conv_w = static_cast<const W*>(p.norm_conv_w) + channel;
      const int64_t items = part.num_tokens * part.streams;
      const unsigned blocks =
          static_cast<unsigned>((items * (int64_t{1} << group_log2) + kThreads - 1) / kThreads);
      const hipError_t status =
          launch_kernel(kernel, blocks, kThreads, 0, stream, part, group_log2);
      if (status != hipSuccess) return status;
    }
  }
  return hipSuccess;
}

}  // namespace

hipError_t launch_ple_gate(const PleGateParams& p, hipStream_t stream) {
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
