// The cache sizes of this machine, read once from sysfs, for any CPU kernel that sizes its work
// or chooses a path by what stays in cache (so far gather_rows' streaming path, for its
// threshold and its block size).
#pragma once

#include <cstdint>

namespace qwen4exp::cpu {

// What one thread of this process can count on keeping in cache: its core's L2 plus its share
// of the L3, from sysfs (cpu0's caches; sizes like "32768K"). The L3 share is the L3 over the
// CPUs that sysfs says share it, capped at kL3ShareCap: inside a VM sysfs lists only the VM's
// own CPUs next to the whole socket's L3 (a 2-CPU VM on a 480 MiB-L3 Xeon sees 240 MiB each),
// and the tenants on the other cores use the rest. (sysconf(_SC_LEVEL3_CACHE_SIZE) is no
// substitute: on EPYC it reports every CCD's L3 together.)
// 4 MiB: the L3 per core of a Zen 4 CCD, more than a Xeon gives a core (V-Cache parts have more).
constexpr int64_t kL3ShareCap = int64_t{4} << 20;
struct CacheShare {
  int64_t l2 = int64_t{1} << 20;  // per core, where sysfs has nothing
  int64_t l3 = int64_t{2} << 20;  // per CPU
};

// This process's CacheShare, read from sysfs on the first call (CacheShare's defaults for what
// sysfs does not say).
const CacheShare& cache_share();

}  // namespace qwen4exp::cpu
