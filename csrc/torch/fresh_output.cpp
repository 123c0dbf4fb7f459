// Fresh outputs of the CPU ops made resident cheaply (fresh_output.h), and their ops: the
// allocation empty_cpu_output that ops.py calls for the outputs it allocates, and its switches
// (python/qwen4exp_ext/cpu_tuning.py).
#include "fresh_output.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14; older kernels answer EINVAL: faults as before
#endif

namespace qwen4exp {
namespace {

constexpr int64_t kHugePage = int64_t{2} << 20;
// glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: below it, glibc's dynamic threshold may serve a
// block from its heap, memory already resident from an earlier output of that size, which no
// mapping of ours can beat; from it on, every block is a fresh mapping faulted 4 KiB at a time.
constexpr int64_t kDefaultFreshBytes = int64_t{32} << 20;

std::atomic<int64_t> fresh_bytes_setting{-1};
std::atomic<int64_t> fresh_mode_setting{-1};

// The default mode: huge pages where the kernel gives them to a region advised MADV_HUGEPAGE
// (THP "always" or "madvise"), else the parallel populate. Read once a process.
FreshOutputMode default_mode() {
  static const FreshOutputMode mode = [] {
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
    std::stringstream text;
    text << file.rdbuf();
    const std::string s = text.str();
    const bool huge = s.find("[always]") != std::string::npos ||
                      s.find("[madvise]") != std::string::npos;
    return huge ? FreshOutputMode::kHugePages : FreshOutputMode::kPopulate;
  }();
  return mode;
}

struct Mapping {
  void* addr;
  size_t len;
};

void unmap(void* context) {
  auto* mapping = static_cast<Mapping*>(context);
  munmap(mapping->addr, mapping->len);
  delete mapping;
}

// A private anonymous mapping of `len` bytes (a multiple of the page size) at a 2 MiB boundary,
// as tables/host_memory.py's _map makes a host table's: over-mapped by 2 MiB, the unaligned head
// and tail unmapped. nullptr where mmap fails.
void* map_aligned(size_t len) {
  const size_t over = len + kHugePage;
  void* raw = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t addr = (start + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
  if (addr > start) munmap(raw, addr - start);
  const uintptr_t tail = start + over - (addr + len);
  if (tail > 0) munmap(reinterpret_cast<void*>(addr + len), tail);
  return reinterpret_cast<void*>(addr);
}

// Makes [addr, addr + len) resident on ATen's threads, a 2 MiB chunk a call: the kernel zeroes
// each page as a fault would, without the fault's trap and return every 4 KiB.
void populate(char* addr, size_t len) {
  const int64_t chunks = static_cast<int64_t>((len + kHugePage - 1) / kHugePage);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const size_t from = static_cast<size_t>(begin * kHugePage);
    const size_t to = std::min(len, static_cast<size_t>(end * kHugePage));
    madvise(addr + from, to - from, MADV_POPULATE_WRITE);  // EINVAL (old kernel): faults later
  });
}

template <int64_t kMax>
int64_t check_setting(const char* name, const char* what, int64_t value) {
  TORCH_CHECK_VALUE(value >= -1 && value <= kMax, name, ": ", what, ", got ", value);
  return value;
}

}  // namespace

int64_t cpu_fresh_output_bytes() {
  const int64_t set = fresh_bytes_setting.load(std::memory_order_relaxed);
  return set >= 0 ? set : kDefaultFreshBytes;
}

int64_t set_cpu_fresh_output_bytes(int64_t bytes) {
  check_setting<INT64_MAX>("set_cpu_fresh_output_bytes",
                           "bytes must be >= 0 (or -1 for the default)", bytes);
  return fresh_bytes_setting.exchange(bytes);
}

int64_t cpu_fresh_output_mode() {
  const int64_t set = fresh_mode_setting.load(std::memory_order_relaxed);
  return set >= 0 ? set : static_cast<int64_t>(default_mode());
}

int64_t set_cpu_fresh_output_mode(int64_t mode) {
  check_setting<static_cast<int64_t>(FreshOutputMode::kPopulate)>(
      "set_cpu_fresh_output_mode", "mode must be 0 (huge pages), 1 (populate) or -1 (the default)",
      mode);
  return fresh_mode_setting.exchange(mode);
}

at::Tensor empty_cpu_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(sizes);
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (nbytes == 0 || nbytes < cpu_fresh_output_bytes()) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = (static_cast<size_t>(nbytes) + page - 1) / page * page;
  void* addr = map_aligned(len);
  if (addr == nullptr) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  // Advice before the first touch: it decides which pages the faults allocate. EINVAL means a
  // kernel without THP: ordinary pages.
  if (static_cast<FreshOutputMode>(cpu_fresh_output_mode()) == FreshOutputMode::kHugePages) {
    madvise(addr, len, MADV_HUGEPAGE);
  } else {
    populate(static_cast<char*>(addr), len);
  }
  // Resizable, with the CPU allocator: a resize_ past it moves the data to torch's memory and
  // frees this mapping through its deleter, as any CPU storage.
  c10::DataPtr data(addr, new Mapping{addr, len}, &unmap, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(dtype));
  out.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return out;
}

}  // namespace qwen4exp

TORCH_LIBRARY_FRAGMENT(qwen4exp, m) {
  // An uninitialised contiguous CPU tensor for an op's output (fresh_output.h): a mapping of its
  // own, made resident cheaply, from cpu_fresh_output_bytes() bytes on; torch.empty below.
  m.def("empty_cpu_output(int[] size, ScalarType dtype) -> Tensor",
        [](c10::IntArrayRef size, c10::ScalarType dtype) {
          for (const int64_t s : size) {
            TORCH_CHECK_VALUE(s >= 0, "empty_cpu_output: size must be >= 0, got ", size);
          }
          return qwen4exp::empty_cpu_output(size, dtype);
        });
  // The size from which it maps (-1 to the setter: the default, 32 MiB); the setter returns the
  // setting it replaces.
  m.def("cpu_fresh_output_bytes() -> int", &qwen4exp::cpu_fresh_output_bytes);
  m.def("set_cpu_fresh_output_bytes(int bytes) -> int", &qwen4exp::set_cpu_fresh_output_bytes);
  // How it makes them resident: 0 huge pages, 1 the parallel MADV_POPULATE_WRITE; -1 to the
  // setter: the default (huge pages unless THP is "never").
  m.def("cpu_fresh_output_mode() -> int", &qwen4exp::cpu_fresh_output_mode);
  m.def("set_cpu_fresh_output_mode(int mode) -> int", &qwen4exp::set_cpu_fresh_output_mode);
}
