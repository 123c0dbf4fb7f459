// Fresh outputs of the CPU ops without the page-fault tax (issue #51 item 3). A large tensor an
// op returns (ple_gate's two outputs and the hyper-connection ops' (hc_entries.h) here;
// gather_rows', ngram_gather_rows' and ngram_ids' through
// the op empty_cpu_output that ops.py calls) is its own anonymous mapping, 2 MiB-aligned, made
// resident cheaply before the kernel writes it: advised MADV_HUGEPAGE while untouched, so that
// the kernel's threads fault it in 2 MiB at a time (transparent huge pages in "madvise" or
// "always" mode), or else populated with MADV_POPULATE_WRITE in parallel chunks on ATen's
// threads (one call a chunk instead of one fault every 4 KiB). torch's allocator gets such a
// block from glibc as a fresh mapping of 4 KiB pages, faulted one at a time as the kernel writes:
// with ple_gate at prefill that doubled the op's time.
//
// Even on huge pages the kernel still zeroes every fresh page (with ple_gate at prefill, 1.4x to
// 1.8x the out= call). So a freed output's mapping, resident, is kept in a bounded cache (as
// torch's CUDA caching allocator keeps device blocks) and the next fresh output it fits takes it
// as it is: no fault, no zeroing. It fits an output of `len` bytes (page-rounded) when it has
// [len, 2 * len) bytes; the cache holds at most cpu_fresh_output_cache_bytes() (default 512 MiB,
// at most an eighth of RAM; 0: off), dropping its oldest mappings (munmap) to make room, and
// empty_fresh_output_cache() unmaps all of it. A reused output holds a former output's bytes, as
// at::empty's may: every op that allocates one writes every element of it (gather_rows' rows of
// ids outside its vocab shard as zeros). Per process: a forked child unmaps its copies of the
// cached mappings and starts empty (pthread_atfork); its outputs' mappings are its own.
//
// The result is an ordinary resizable CPU tensor; its storage returns the mapping to the cache
// (or unmaps it) when freed. Below cpu_fresh_output_bytes() (default 32 MiB: glibc's largest
// mmap threshold, under which it may hand back warm heap memory that faults nothing) it is
// at::empty, as before.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace qwen4exp {

// How a fresh output is made resident: its codes for the setter and the Python names
// (cpu_tuning._FRESH_OUTPUT_MODES).
enum class FreshOutputMode : int64_t { kHugePages = 0, kPopulate = 1 };

// An uninitialised contiguous CPU tensor of `sizes` and `dtype`: a mapping of its own, made
// resident as above, when it has at least cpu_fresh_output_bytes() bytes; at::empty otherwise
// (and where the mapping fails: torch's allocator then reports the shortage).
at::Tensor empty_cpu_output(at::IntArrayRef sizes, at::ScalarType dtype);

// The size in bytes from which empty_cpu_output maps; the setter takes bytes >= 0, or -1 for the
// default, and returns the setting it replaces (-1: the default).
int64_t cpu_fresh_output_bytes();
int64_t set_cpu_fresh_output_bytes(int64_t bytes);

// The cache's cap in bytes (above); the setter takes bytes >= 0 (0: no cache) or -1 for the
// default, unmaps what the new cap cannot hold (oldest first) and returns the setting it replaces
// (-1: the default).
int64_t cpu_fresh_output_cache_bytes();
int64_t set_cpu_fresh_output_cache_bytes(int64_t bytes);

// What the cache holds: (bytes, mappings).
std::tuple<int64_t, int64_t> fresh_output_cache_held();

// Unmaps every mapping the cache holds; returns their bytes.
int64_t empty_fresh_output_cache();

// FreshOutputMode's code in use: by default huge pages unless THP is "never" (or absent); the
// setter takes -1 (that default) or a code and returns the setting it replaces.
int64_t cpu_fresh_output_mode();
int64_t set_cpu_fresh_output_mode(int64_t mode);

}  // namespace qwen4exp
