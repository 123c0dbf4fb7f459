// read_file_rows (csrc/common/read_file_rows.h): table rows from a file, by pread.
//
// A decode step wants ~1024 random rows of a layer's table, a prefill ~131k, from a file of
// 51-102 GB: on NVMe that is latency-bound (~100 us a random 4 KiB read) unless many reads are in
// flight at once. So:
// 1. every owned id becomes a request (its offset, its output row), checked before anything is
//    read; ids not owned get a zero row here;
// 2. the requests are sorted by offset, and consecutive requests whose spans share or touch a
//    kFileRowsBlock block join one read (up to kFileRowsMaxRead bytes): a row wanted twice, or
//    rows in one block, are read once, and a run of neighbouring rows is one long read;
// 3. without O_DIRECT, this thread first does the reads the page cache can serve (RWF_NOWAIT:
//    probe_page_cache), so that cached rows start no threads;
// 4. without O_DIRECT, the reads left are advised to the kernel's readahead (advise_pending);
// 5. io_threads threads (std::thread, started here and joined before returning) take the reads
//    left in offset order from an atomic counter, each pread into its own aligned bounce buffer,
//    and copy the rows out. With O_DIRECT a read covers whole aligned blocks (offset, length and
//    buffer aligned to kFileRowsBlock); without it, only the bytes from its first row's start to
//    its last row's end.
// A read that ends early (EOF) is an error only for the rows it did not cover: an O_DIRECT read of
// the file's last, partial block returns short, and the rows before EOF are whole.
//
// The workers touch only raw pointers (pread, memcpy); each keeps its first error, and the one of
// the lowest read is returned once all have joined.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../common/read_file_rows.h"

namespace qwen4exp {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008  // linux/fs.h, Linux 4.14; older glibc headers lack it
#endif

struct Request {
  int64_t offset;  // of the row in the file
  int64_t row;     // output row
};

// One pread: [offset, offset + length) of the file, for requests [first, last) (sorted).
struct Read {
  int64_t offset;
  int64_t length;
  int64_t first;
  int64_t last;
};

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, AlignedFree>;

std::string file_name(const ReadFileRowsParams& p) {
  if (p.path != nullptr && p.path[0] != '\0') return p.path;
  return "fd " + std::to_string(p.fd);
}

ReadFileRowsStatus failure(std::string message, int errno_value = 0) {
  return ReadFileRowsStatus{"read_file_rows: " + std::move(message), errno_value};
}

int64_t round_down(int64_t x) { return x / kFileRowsBlock * kFileRowsBlock; }
// The caller has checked that x + kFileRowsBlock - 1 fits.
int64_t round_up(int64_t x) { return round_down(x + kFileRowsBlock - 1); }

// The shared state of one call's workers.
struct Job {
  const ReadFileRowsParams& p;
  const std::string& name;
  bool direct;
  const std::vector<Request>& requests;
  const std::vector<Read>& reads;
  const std::vector<int64_t>& pending;  // the reads left to the workers (indices into reads)
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> failed_silently{false};  // an error whose message could not be built
  std::mutex mutex;
  int64_t error_read = kInt64Max;  // the read of `error`, under `mutex`
  ReadFileRowsStatus error;

  void fail(int64_t read, ReadFileRowsStatus status) {
    stop.store(true, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mutex);
    if (read < error_read) {
      error_read = read;
      error = std::move(status);
    }
  }

  // Reads `r` into `buffer`; the bytes it got (< length only at EOF), or -1 after fail().
  int64_t pread_all(int64_t index, const Read& r, uint8_t* buffer) {
    int64_t done = 0;
    while (done < r.length) {
      const ssize_t got = ::pread(p.fd, buffer + done, static_cast<size_t>(r.length - done),
                                  static_cast<off_t>(r.offset + done));
      if (got < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        fail(index,
             failure(name + ": pread of " + std::to_string(r.length - done) + " bytes at offset " +
                         std::to_string(r.offset + done) + " failed: " + std::strerror(e),
                     e));
        return -1;
      }
      if (got == 0) break;  // EOF
      done += got;
      // O_DIRECT returns a partial block only at EOF; the next offset would not be aligned.
      if (direct && got % kFileRowsBlock != 0) break;
    }
    return done;
  }

  void short_read(int64_t index, const Read& r, int64_t got, const Request& q) {
    const int64_t id = (q.offset - p.data_offset) / p.row_bytes;
    std::string size;
    struct stat st;
    if (::fstat(p.fd, &st) == 0) size = "; the file has " + std::to_string(st.st_size) + " bytes";
    fail(index,
         failure(name + " ends before row " + std::to_string(id) + " (its bytes [" +
                 std::to_string(q.offset) + ", " + std::to_string(q.offset + p.row_bytes) +
                 "); a read of " + std::to_string(r.length) + " bytes at offset " +
                 std::to_string(r.offset) + " returned " + std::to_string(got) + size + ")"));
  }

  // A worker's loop: nothing escapes it (an exception leaving a std::thread ends the process).
  void work() {
    try {
      work_unchecked();
    } catch (const std::exception& e) {
      try {
        fail(kInt64Max - 1, failure(name + ": " + e.what()));
      } catch (...) {
        stop.store(true, std::memory_order_relaxed);
        failed_silently.store(true, std::memory_order_relaxed);
      }
    }
  }

  void work_unchecked() {
    Buffer buffer;
    int64_t capacity = 0;
    for (;;) {
      if (stop.load(std::memory_order_relaxed)) return;
      const int64_t slot = next.fetch_add(1, std::memory_order_relaxed);
      if (slot >= static_cast<int64_t>(pending.size())) return;
      const int64_t index = pending[slot];
      const Read& r = reads[index];
      if (r.length > capacity) {
        const int64_t size = round_up(r.length);
        buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(kFileRowsBlock, size)));
        if (!buffer) {
          capacity = 0;
          fail(index, failure(name + ": cannot allocate a read buffer of " + std::to_string(size) +
                                  " bytes",
                              ENOMEM));
          return;
        }
        capacity = size;
      }
      const int64_t got = pread_all(index, r, buffer.get());
      if (got < 0 || !copy_rows(index, r, got, buffer.get())) return;
    }
  }

  // Copies the rows of `r` out of its `got` bytes in `buffer`; false after fail() when the read
  // ended before one of them.
  bool copy_rows(int64_t index, const Read& r, int64_t got, const uint8_t* buffer) {
    for (int64_t i = r.first; i < r.last; ++i) {
      const Request& q = requests[i];
      const int64_t at = q.offset - r.offset;
      if (at + p.row_bytes > got) {
        short_read(index, r, got, q);
        return false;
      }
      std::memcpy(p.output + q.row * p.output_row_stride, buffer + at,
                  static_cast<size_t>(p.row_bytes));
    }
    return true;
  }
};

// Without O_DIRECT, rows the page cache holds cost a copy, not an I/O: starting io_threads
// threads to wait on nothing costs more (~3 ms for 32 threads and 1024 cached rows on a 2-core VM,
// against ~1 ms for all of it on one thread). So this thread first reads what it can with
// RWF_NOWAIT (preadv2 fails with EAGAIN instead of waiting for the device), in file order, and
// leaves to the workers every read it could not finish: all of them after `misses` misses (a cold
// file then costs that many extra syscalls, ~1 us each, before its reads start), or when the file
// or kernel cannot do RWF_NOWAIT. Returns the reads done here, or -1 after job.fail().
int64_t probe_page_cache(Job& job, int64_t misses, std::vector<int64_t>& pending) {
  const int64_t count = static_cast<int64_t>(job.reads.size());
  int64_t i = 0, done = 0;
  Buffer buffer;
  int64_t capacity = 0;
  for (; i < count && misses > 0; ++i) {
    const Read& r = job.reads[i];
    if (r.length > capacity) {
      buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(kFileRowsBlock, round_up(r.length))));
      if (!buffer) break;  // the workers allocate their own, and report it
      capacity = round_up(r.length);
    }
    struct iovec iov = {buffer.get(), static_cast<size_t>(r.length)};
    const ssize_t got = ::preadv2(job.p.fd, &iov, 1, static_cast<off_t>(r.offset), RWF_NOWAIT);
    if (got == r.length) {
      if (!job.copy_rows(i, r, got, buffer.get())) return -1;
      ++done;
      continue;
    }
    // EAGAIN: not cached. A short count: partly cached, or EOF; the workers' blocking read tells.
    // Any other error (no RWF_NOWAIT here, or the read's own): the workers retry and report it.
    pending.push_back(i);
    --misses;
    if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      ++i;
      break;
    }
  }
  for (; i < count; ++i) pending.push_back(i);
  return done;
}

// Without O_DIRECT, the reads the page cache could not serve are first handed to the kernel's
// readahead (POSIX_FADV_WILLNEED, in file order), as vLLM 0.34's disk_offload does before its
// serial preads: the kernel queues them all at once, so the device has every read in flight
// whatever the number of threads, and the workers' preads wait for pages already on their way.
// Measured on a 2-core Zen 4 KVM (virtio disk), 1024 cold random rows of a 640 MB file: without
// the advice 49-65 ms on 1 thread, 15-18 ms on 32; with it 11-16 ms on either; in the
// vllm_disk_offload bench (results/, 1 / 2 threads), cold decode went from 0.87x / 0.79x to
// 0.99x / 1.00x of vLLM's staging and cold prefill (131k rows) from 1.14x / 1.17x to 1.32x /
// 1.23x. Advice only: an error here changes nothing, the
// preads report their own.
void advise_pending(const Job& job) {
  for (const int64_t i : job.pending) {
    const Read& r = job.reads[i];
    ::posix_fadvise(job.p.fd, static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                    POSIX_FADV_WILLNEED);
  }
}

}  // namespace

ReadFileRowsStatus run_read_file_rows_cpu(const ReadFileRowsParams& p) {
  const std::string name = file_name(p);
  // --- checks: nothing is read (or written) before every one has passed -----------------------
  if (p.row_bytes <= 0) {
    return failure("row_bytes must be positive, got " + std::to_string(p.row_bytes));
  }
  if (p.data_offset < 0) {
    return failure("data_offset must be >= 0, got " + std::to_string(p.data_offset));
  }
  if (p.vocab_start < 0 || p.vocab_end < p.vocab_start) {
    return failure("the ids read, [vocab_start, vocab_end) = [" + std::to_string(p.vocab_start) +
                   ", " + std::to_string(p.vocab_end) +
                   "), must satisfy 0 <= vocab_start <= " + "vocab_end");
  }
  if (p.num_ids < 0 || (p.num_ids > 0 && (p.ids == nullptr || p.output == nullptr))) {
    return failure("ids and output must hold num_ids >= 0 rows");
  }
  if (p.num_ids > 1 && p.output_row_stride < p.row_bytes) {
    return failure("output rows overlap: row stride " + std::to_string(p.output_row_stride) +
                   " < row_bytes " + std::to_string(p.row_bytes));
  }
  const int flags = ::fcntl(p.fd, F_GETFL);
  if (flags < 0) {
    const int e = errno;
    return failure(name + ": fd " + std::to_string(p.fd) + " is not an open file descriptor (" +
                       std::strerror(e) + ")",
                   e);
  }
  if ((flags & O_ACCMODE) == O_WRONLY) {
    return failure(name + ": fd " + std::to_string(p.fd) + " is not open for reading", EBADF);
  }
  const bool direct = (flags & O_DIRECT) != 0;
  if (direct && p.data_offset % kFileRowsBlock != 0) {
    return failure(name + ": with O_DIRECT, data_offset must be a multiple of " +
                   std::to_string(kFileRowsBlock) + ", got " + std::to_string(p.data_offset));
  }

  // --- requests, each row's offset checked; zero rows for the ids this reader does not own ----
  std::vector<Request> requests;
  requests.reserve(static_cast<size_t>(p.num_ids));
  // The largest end offset that still rounds up to a block without overflowing.
  const int64_t max_end = kInt64Max - (kFileRowsBlock - 1);
  for (int64_t k = 0; k < p.num_ids; ++k) {
    const int64_t at = k * p.ids_stride;
    const int64_t id = p.ids_int64 ? static_cast<const int64_t*>(p.ids)[at]
                                   : int64_t{static_cast<const int32_t*>(p.ids)[at]};
    if (id < p.vocab_start || id >= p.vocab_end) continue;
    int64_t offset = 0, end = 0;
    if (__builtin_mul_overflow(id, p.row_bytes, &offset) ||
        __builtin_add_overflow(offset, p.data_offset, &offset) ||
        __builtin_add_overflow(offset, p.row_bytes, &end) || end > max_end) {
      return failure(name + ": row " + std::to_string(id) + " (ids[" + std::to_string(k) +
                     "]) is past any file offset: data_offset " + std::to_string(p.data_offset) +
                     " + id * row_bytes " + std::to_string(p.row_bytes) + " overflows int64");
    }
    requests.push_back(Request{offset, k});
  }
  if (static_cast<int64_t>(requests.size()) < p.num_ids) {
    for (int64_t k = 0; k < p.num_ids; ++k) {
      const int64_t at = k * p.ids_stride;
      const int64_t id = p.ids_int64 ? static_cast<const int64_t*>(p.ids)[at]
                                     : int64_t{static_cast<const int32_t*>(p.ids)[at]};
      if (id < p.vocab_start || id >= p.vocab_end) {
        std::memset(p.output + k * p.output_row_stride, 0, static_cast<size_t>(p.row_bytes));
      }
    }
  }
  if (requests.empty()) return {};

  // --- sorted by offset, grouped into reads ---------------------------------------------------
  std::sort(requests.begin(), requests.end(), [](const Request& a, const Request& b) {
    return a.offset < b.offset || (a.offset == b.offset && a.row < b.row);
  });
  std::vector<Read> reads;
  {
    const int64_t n = static_cast<int64_t>(requests.size());
    int64_t first = 0;
    int64_t begin = requests[0].offset;
    int64_t end = begin + p.row_bytes;
    auto flush = [&](int64_t last) {
      const int64_t start = direct ? round_down(begin) : begin;
      const int64_t stop = direct ? round_up(end) : end;
      reads.push_back(Read{start, stop - start, first, last});
    };
    for (int64_t i = 1; i < n; ++i) {
      const int64_t offset = requests[i].offset;
      const int64_t row_end = offset + p.row_bytes;
      // Blocks shared or touching, and the read (as it would be issued) within the cap.
      const bool touches = round_down(offset) <= round_up(end);
      const int64_t new_end = std::max(end, row_end);
      const int64_t length = direct ? round_up(new_end) - round_down(begin) : new_end - begin;
      if (touches && length <= kFileRowsMaxRead) {
        end = new_end;
        continue;
      }
      flush(i);
      first = i;
      begin = offset;
      end = row_end;
    }
    flush(n);
  }

  // --- the reads: first those the page cache holds, on this thread; the rest from io_threads
  // threads -----------------------------------------------------------------------------------
  const int64_t wanted = p.io_threads > 0 ? p.io_threads : kFileRowsDefaultThreads;
  std::vector<int64_t> pending;
  pending.reserve(reads.size());
  Job job{p, name, direct, requests, reads, pending};
  if (!direct) {
    const int64_t probed = probe_page_cache(job, wanted, pending);
    if (probed < 0) return std::move(job.error);
  } else {
    for (int64_t i = 0; i < static_cast<int64_t>(reads.size()); ++i) pending.push_back(i);
  }
  if (pending.empty()) return {};
  if (!direct) advise_pending(job);
  const int64_t threads = std::min<int64_t>(wanted, static_cast<int64_t>(pending.size()));
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back([&job] { job.work(); });
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones started (and this one) do every read
    }
  }
  job.work();
  for (std::thread& w : workers) w.join();
  if (job.error_read != kInt64Max) return std::move(job.error);
  if (job.failed_silently.load()) return failure(name + ": out of memory", ENOMEM);
  return {};
}

}  // namespace qwen4exp
