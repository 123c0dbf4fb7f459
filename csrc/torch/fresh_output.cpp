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
#include <pthread.h>
#include <sys/mman.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>

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

// The cache's default cap: 512 MiB holds the largest working set of fresh outputs one layer's
// functional calls make at prefill (ple_gate's two outputs at T = 8192, 2 x 160 MiB, plus the
// 42 MB gather_rows output beside them), so that each call takes back its predecessor's
// mappings; on a machine with under 4 GiB of RAM an eighth of it, so that memory kept resident
// for reuse stays a small share of what the process may use.
constexpr int64_t kDefaultCacheCap = int64_t{512} << 20;
// Released mappings the cache holds at most. A fixed array, so that the cache allocates nothing
// (and the fork handler below frees nothing but mappings); 64 covers the default cap at the
// 32 MiB threshold 16 times over. Past it the oldest is dropped.
constexpr int kCacheSlots = 64;

std::atomic<int64_t> fresh_bytes_setting{-1};
std::atomic<int64_t> fresh_mode_setting{-1};
std::atomic<int64_t> cache_cap_setting{-1};

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

int64_t default_cache_cap() {
  static const int64_t cap = [] {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return kDefaultCacheCap;
    return std::min(kDefaultCacheCap, static_cast<int64_t>(pages) * page / 8);
  }();
  return cap;
}

int64_t cache_cap() {
  const int64_t set = cache_cap_setting.load(std::memory_order_relaxed);
  return set >= 0 ? set : default_cache_cap();
}

// Released fresh-output mappings, resident (their pages already faulted in and zeroed once),
// kept for the next fresh output they fit, as torch's CUDA caching allocator keeps freed device
// blocks: reusing one costs nothing, where a new mapping costs the kernel zeroing every page
// (at prefill as long as the op itself). Per process: the mappings are private, and a forked
// child drops its copies (on_fork_child). Every member is guarded by `mutex`; the mappings are
// unmapped outside it (munmap of a resident 160 MiB takes milliseconds).
struct Cache {
  std::mutex mutex;
  Mapping slots[kCacheSlots];  // [0, count), oldest first
  int count = 0;
  int64_t bytes = 0;  // sum of slots[i].len
};
Cache cache;

// Removes slot i (under the mutex), keeping the order.
Mapping remove_slot(int i) {
  const Mapping m = cache.slots[i];
  std::copy(cache.slots + i + 1, cache.slots + cache.count, cache.slots + i);
  --cache.count;
  cache.bytes -= static_cast<int64_t>(m.len);
  return m;
}

// Drops the oldest mappings (under the mutex) until `bytes` more fit under `cap` in a free
// slot; the dropped ones go to `dropped` (room for kCacheSlots) for the caller to unmap.
int evict_for(int64_t bytes, int64_t cap, Mapping* dropped) {
  int n = 0;
  while (cache.count > 0 && (cache.bytes + bytes > cap || cache.count == kCacheSlots)) {
    dropped[n++] = remove_slot(0);
  }
  return n;
}

int64_t unmap_all(const Mapping* mappings, int n) {
  int64_t bytes = 0;
  for (int i = 0; i < n; ++i) {
    munmap(mappings[i].addr, mappings[i].len);
    bytes += static_cast<int64_t>(mappings[i].len);
  }
  return bytes;
}

// A cached mapping of `len` bytes or more for a fresh output of `len` (page-rounded) bytes, or
// {nullptr, 0}. Only one shorter than 2 * len: a small output never pins a large mapping (at
// most half of what it holds goes unused), and a large one's mapping stays for its like.
// The smallest that fits.
Mapping take_cached(size_t len) {
  std::lock_guard<std::mutex> lock(cache.mutex);
  int best = -1;
  for (int i = 0; i < cache.count; ++i) {
    const size_t have = cache.slots[i].len;
    if (have >= len && have / 2 < len && (best < 0 || have < cache.slots[best].len)) best = i;
  }
  return best < 0 ? Mapping{nullptr, 0} : remove_slot(best);
}

// The storage's deleter: the mapping goes to the cache, the oldest ones out to make room under
// the cap; past the cap (0: the cache is off) it is unmapped.
void release(void* context) {
  auto* mapping = static_cast<Mapping*>(context);
  const Mapping m = *mapping;
  delete mapping;
#ifdef MADV_FREE
  // The kernel may take an idle cached mapping's pages back under memory pressure, as it takes
  // file pages: what the cache keeps for reuse never forces anything out. Until it does, the
  // pages stay mapped and the next output writes them with no fault (a write makes a page dirty
  // again, hence kept); a page taken back faults in zeroed, as a new mapping's. Before the
  // mapping enters the cache, never after: a page its next owner has already written would be
  // marked free again. EINVAL (a kernel before 4.5): the pages stay resident.
  if (static_cast<int64_t>(m.len) <= cache_cap()) madvise(m.addr, m.len, MADV_FREE);
#endif
  Mapping dropped[kCacheSlots + 1];
  int n = 0;
  {
    // The cap read under the mutex: set_cpu_fresh_output_cache_bytes changes it under it.
    std::lock_guard<std::mutex> lock(cache.mutex);
    const int64_t cap = cache_cap();
    if (static_cast<int64_t>(m.len) > cap) {
      dropped[n++] = m;
    } else {
      n = evict_for(static_cast<int64_t>(m.len), cap, dropped);
      cache.slots[cache.count++] = m;
      cache.bytes += static_cast<int64_t>(m.len);
    }
  }
  unmap_all(dropped, n);
}

// fork(): the child gets a copy of the cache and, copy-on-write, of its mappings. The mutex is
// held across the fork, so that the child's copy is consistent and not locked by a thread the
// child lacks; the child then unmaps its copies (reusing them would fault every page in again,
// copied, and they would keep the parent's pages referenced) and starts with an empty cache.
// Its own outputs' mappings are its own: nothing is freed twice.
void on_fork_prepare() { cache.mutex.lock(); }
void on_fork_parent() { cache.mutex.unlock(); }
void on_fork_child() {
  unmap_all(cache.slots, cache.count);
  cache.count = 0;
  cache.bytes = 0;
  cache.mutex.unlock();
}
[[maybe_unused]] const int fork_handlers =
    pthread_atfork(&on_fork_prepare, &on_fork_parent, &on_fork_child);

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

int64_t cpu_fresh_output_cache_bytes() { return cache_cap(); }

int64_t set_cpu_fresh_output_cache_bytes(int64_t bytes) {
  check_setting<INT64_MAX>("set_cpu_fresh_output_cache_bytes",
                           "bytes must be >= 0 (or -1 for the default)", bytes);
  Mapping dropped[kCacheSlots];
  int n = 0;
  int64_t previous = 0;
  {
    // Under the mutex, so that no release between the exchange and the trim keeps more.
    std::lock_guard<std::mutex> lock(cache.mutex);
    previous = cache_cap_setting.exchange(bytes);
    n = evict_for(0, cache_cap(), dropped);
  }
  unmap_all(dropped, n);
  return previous;
}

std::tuple<int64_t, int64_t> fresh_output_cache_held() {
  std::lock_guard<std::mutex> lock(cache.mutex);
  return {cache.bytes, cache.count};
}

int64_t empty_fresh_output_cache() {
  Mapping dropped[kCacheSlots];
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    n = cache.count;
    std::copy(cache.slots, cache.slots + n, dropped);
    cache.count = 0;
    cache.bytes = 0;
  }
  return unmap_all(dropped, n);
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
  size_t len = (static_cast<size_t>(nbytes) + page - 1) / page * page;
  // A released mapping that fits is resident already: no advice, no fault, no zeroing. Its
  // contents are a former output's, as at::empty's may be: every caller writes all of it.
  const Mapping cached = take_cached(len);
  void* addr = cached.addr;
  if (addr != nullptr) {
    len = cached.len;
  } else {
    addr = map_aligned(len);
    if (addr == nullptr) return at::empty(sizes, at::TensorOptions().dtype(dtype));
    // Advice before the first touch: it decides which pages the faults allocate. EINVAL means
    // a kernel without THP: ordinary pages.
    if (static_cast<FreshOutputMode>(cpu_fresh_output_mode()) == FreshOutputMode::kHugePages) {
      madvise(addr, len, MADV_HUGEPAGE);
    } else {
      populate(static_cast<char*>(addr), len);
    }
  }
  // Resizable, with the CPU allocator: a resize_ past it moves the data to torch's memory and
  // frees this mapping through its deleter, as any CPU storage.
  c10::DataPtr data(addr, new Mapping{addr, len}, &release, at::Device(at::kCPU));
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
  // The cache of released mappings (fresh_output.h): its cap in bytes (-1 to the setter: the
  // default; 0: off), what it holds (bytes, mappings), and emptying it (returns the bytes
  // unmapped).
  m.def("cpu_fresh_output_cache_bytes() -> int", &qwen4exp::cpu_fresh_output_cache_bytes);
  m.def("set_cpu_fresh_output_cache_bytes(int bytes) -> int",
        &qwen4exp::set_cpu_fresh_output_cache_bytes);
  m.def("fresh_output_cache_held() -> (int, int)", &qwen4exp::fresh_output_cache_held);
  m.def("empty_fresh_output_cache() -> int", &qwen4exp::empty_fresh_output_cache);
  m.def("cpu_fresh_output_mode() -> int", &qwen4exp::cpu_fresh_output_mode);
  m.def("set_cpu_fresh_output_mode(int mode) -> int", &qwen4exp::set_cpu_fresh_output_mode);
}
