// Runs gather_rows through the installed library's launcher: a 7-row fp32 table gathered into
// bf16 rows for ids that include ones outside the table (zero rows, SPEC §4), and checks every
// element. Exits 0 when all match. Device memory on CUDA/HIP, host memory on the SIMT backend.
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/float_types.h"
#include "common/gather_rows.h"

namespace {

constexpr int kRows = 7, kWidth = 12, kTokens = 3, kHeads = 2;

#if defined(QWEN4EXP_SIMT)
void* device_copy(const void* host, size_t bytes) {
  void* p = ::operator new(bytes);
  std::memcpy(p, host, bytes);
  return p;
}
void copy_back(void* host, const void* device, size_t bytes) { std::memcpy(host, device, bytes); }
bool synchronize() { return true; }
#else
// The runtime's own names (CUDA or HIP) for the few calls a host program needs.
#if defined(QWEN4EXP_CUDA)
#define QWEN4EXP_RUNTIME(name) cuda##name
#else
#define QWEN4EXP_RUNTIME(name) hip##name
#endif
void* device_copy(const void* host, size_t bytes) {
  void* p = nullptr;
  if (QWEN4EXP_RUNTIME(Malloc)(&p, bytes) != hipSuccess) return nullptr;
  const auto status =
      QWEN4EXP_RUNTIME(Memcpy)(p, host, bytes, QWEN4EXP_RUNTIME(MemcpyHostToDevice));
  return status == hipSuccess ? p : nullptr;
}
void copy_back(void* host, const void* device, size_t bytes) {
  (void)QWEN4EXP_RUNTIME(Memcpy)(host, device, bytes, QWEN4EXP_RUNTIME(MemcpyDeviceToHost));
}
bool synchronize() { return QWEN4EXP_RUNTIME(DeviceSynchronize)() == hipSuccess; }
#endif

}  // namespace

int main() {
  using namespace qwen4exp;
  std::vector<float> table(kRows * kWidth);
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kWidth; ++c) table[r * kWidth + c] = static_cast<float>(r * 16 + c);
  }
  const std::vector<int64_t> ids = {0, 6, -1, 3, 7, 2};  // -1 and 7 are outside the table
  std::vector<bf16_t> output(kTokens * kHeads * kWidth, bf16_t{0xFFFF});

  GatherRowsParams p{};
  p.table = device_copy(table.data(), table.size() * sizeof(float));
  p.table_row_stride = kWidth;
  p.rows = kRows;
  p.width = kWidth;
  p.ids = device_copy(ids.data(), ids.size() * sizeof(int64_t));
  p.ids_row_stride = kHeads;
  p.ids_col_stride = 1;
  p.ids_int64 = true;
  void* out = device_copy(output.data(), output.size() * sizeof(bf16_t));
  p.output = out;
  p.output_row_stride = kHeads * kWidth;
  p.num_tokens = kTokens;
  p.num_heads = kHeads;
  p.vocab_start = 0;
  p.vocab_end = kRows;
  p.table_dtype = Dtype::kF32;
  p.out_dtype = Dtype::kBF16;
  if (p.table == nullptr || p.ids == nullptr || out == nullptr) {
    std::printf("run_gather: could not allocate device memory\n");
    return 1;
  }
  const hipError_t status = launch_gather_rows(p, hipStream_t{});
  if (status != hipSuccess || !synchronize()) {
    std::printf("run_gather: launch failed (%d)\n", static_cast<int>(status));
    return 1;
  }
  copy_back(output.data(), out, output.size() * sizeof(bf16_t));

  int wrong = 0;
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      const int64_t id = ids[t * kHeads + h];
      for (int c = 0; c < kWidth; ++c) {
        const float expected = (id >= 0 && id < kRows) ? static_cast<float>(id * 16 + c) : 0.0f;
        const float got = to_float(output[(t * kHeads + h) * kWidth + c]);
        if (got != expected) {
          if (wrong++ < 5) {
            std::printf("token %d head %d column %d: %g, want %g\n", t, h, c, got, expected);
          }
        }
      }
    }
  }
  if (wrong != 0) {
    std::printf("run_gather: %d of %d elements wrong\n", wrong, kTokens * kHeads * kWidth);
    return 1;
  }
  std::printf("run_gather: %d rows gathered through qwen4exp::kernels, all as expected\n",
              kTokens * kHeads);
  return 0;
}
