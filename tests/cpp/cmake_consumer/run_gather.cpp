// A C++ engine's use of the installed kernel library: gather_rows run on the CPU kernel
// (qwen4exp::cpu_kernels, run_gather_rows_cpu) and, where the package has a backend, through its
// launcher (qwen4exp::kernels: device memory on CUDA/HIP, host memory on the SIMT emulator). An
// fp32 table is gathered into bf16 rows for ids that include ones outside the table (zero rows,
// SPEC §4); every element is checked against the table, and the two runs against each other.
// Two sizes: one block of rows, and enough rows that the CPU kernel splits them over its threads.
// Exits 0 when everything matches.
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/float_types.h"
#include "common/gather_rows.h"

using namespace qwen4exp;

namespace {

constexpr int kRows = 7, kWidth = 12;

struct Case {
  int tokens;
  int heads;
  std::vector<float> table;
  std::vector<int64_t> ids;  // [tokens, heads]
};

Case make_case(int tokens, int heads) {
  Case c{tokens, heads, std::vector<float>(kRows * kWidth), {}};
  for (int r = 0; r < kRows; ++r) {
    for (int col = 0; col < kWidth; ++col) c.table[r * kWidth + col] = float(r * 16 + col);
  }
  // Ids in [-2, kRows + 2): -2, -1, kRows and kRows + 1 are outside the table.
  uint32_t state = 12345;
  for (int i = 0; i < tokens * heads; ++i) {
    state = state * 1664525u + 1013904223u;
    c.ids.push_back(static_cast<int64_t>(state >> 8) % (kRows + 4) - 2);
  }
  return c;
}

GatherRowsParams params_for(const Case& c, const void* table, const void* ids, void* output) {
  GatherRowsParams p{};
  p.table = table;
  p.table_row_stride = kWidth;
  p.rows = kRows;
  p.width = kWidth;
  p.ids = ids;
  p.ids_row_stride = c.heads;
  p.ids_col_stride = 1;
  p.ids_int64 = true;
  p.output = output;
  p.output_row_stride = c.heads * kWidth;
  p.num_tokens = c.tokens;
  p.num_heads = c.heads;
  p.vocab_start = 0;
  p.vocab_end = kRows;
  p.table_dtype = Dtype::kF32;
  p.out_dtype = Dtype::kBF16;
  return p;
}

// The elements of `output` that differ from the table's rows (zero rows for outside ids).
int count_wrong(const char* where, const Case& c, const std::vector<bf16_t>& output) {
  int wrong = 0;
  for (int i = 0; i < c.tokens * c.heads; ++i) {
    const int64_t id = c.ids[i];
    for (int col = 0; col < kWidth; ++col) {
      const float expected = (id >= 0 && id < kRows) ? float(id * 16 + col) : 0.0f;
      const float got = to_float(output[i * kWidth + col]);
      if (got != expected && wrong++ < 5) {
        std::printf("%s: row %d column %d: %g, want %g\n", where, i, col, got, expected);
      }
    }
  }
  return wrong;
}

std::vector<bf16_t> run_on_cpu(const Case& c) {
  std::vector<bf16_t> output(c.tokens * c.heads * kWidth, bf16_t{0xFFFF});
  run_gather_rows_cpu(params_for(c, c.table.data(), c.ids.data(), output.data()));
  return output;
}

#if defined(QWEN4EXP_HAS_LAUNCHERS)
#if defined(QWEN4EXP_SIMT)
void* device_copy(const void* host, size_t bytes) {
  void* p = ::operator new(bytes);
  std::memcpy(p, host, bytes);
  return p;
}
void copy_back(void* host, const void* device, size_t bytes) { std::memcpy(host, device, bytes); }
bool synchronize() { return true; }
const char* const kBackend = "simt";
#else
// The runtime's own names (CUDA or HIP) for the few calls a host program needs.
#if defined(QWEN4EXP_CUDA)
#define QWEN4EXP_RUNTIME(name) cuda##name
const char* const kBackend = "cuda";
#else
#define QWEN4EXP_RUNTIME(name) hip##name
const char* const kBackend = "hip";
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

// The launcher's output, or an empty vector when it could not run.
std::vector<bf16_t> run_on_backend(const Case& c) {
  std::vector<bf16_t> output(c.tokens * c.heads * kWidth, bf16_t{0xFFFF});
  const size_t out_bytes = output.size() * sizeof(bf16_t);
  const void* table = device_copy(c.table.data(), c.table.size() * sizeof(float));
  const void* ids = device_copy(c.ids.data(), c.ids.size() * sizeof(int64_t));
  void* out = device_copy(output.data(), out_bytes);
  if (table == nullptr || ids == nullptr || out == nullptr) {
    std::printf("run_gather: %s: could not allocate device memory\n", kBackend);
    return {};
  }
  const hipError_t status = launch_gather_rows(params_for(c, table, ids, out), hipStream_t{});
  if (status != hipSuccess || !synchronize()) {
    std::printf("run_gather: %s: launch failed (%d)\n", kBackend, static_cast<int>(status));
    return {};
  }
  copy_back(output.data(), out, out_bytes);
  return output;
}
#endif

}  // namespace

int main() {
  int failures = 0;
  for (const auto& [tokens, heads] : {std::pair{3, 2}, std::pair{300, 16}}) {
    const Case c = make_case(tokens, heads);
    const std::vector<bf16_t> cpu = run_on_cpu(c);
    failures += count_wrong("cpu", c, cpu) != 0;
    std::printf("run_gather: cpu: %d rows\n", tokens * heads);
#if defined(QWEN4EXP_HAS_LAUNCHERS)
    const std::vector<bf16_t> backend = run_on_backend(c);
    if (backend.empty() || count_wrong(kBackend, c, backend) != 0) {
      ++failures;
    } else if (std::memcmp(backend.data(), cpu.data(), cpu.size() * sizeof(bf16_t)) != 0) {
      std::printf("run_gather: %s and cpu outputs differ\n", kBackend);
      ++failures;
    }
    std::printf("run_gather: %s: %d rows\n", kBackend, tokens * heads);
#endif
  }
  if (failures != 0) {
    std::printf("run_gather: FAIL (%d)\n", failures);
    return 1;
  }
  std::printf("run_gather: every row as expected\n");
  return 0;
}
