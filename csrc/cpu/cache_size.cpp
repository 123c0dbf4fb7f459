// cache_size.h: the caches of cpu0, from sysfs.
#include "cache_size.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

namespace qwen4exp::cpu {
namespace {

int64_t sysfs_cache_bytes(const std::string& size) {
  int64_t value = std::strtoll(size.c_str(), nullptr, 10);
  const char unit = size.empty() ? '\0' : size.back();
  if (unit == 'K') value <<= 10;
  if (unit == 'M') value <<= 20;
  return value;
}

// CPUs in a sysfs list such as "0-3,8-11".
int64_t sysfs_cpu_count(const std::string& list) {
  int64_t count = 0;
  const char* p = list.c_str();
  while (*p != '\0') {
    char* end = nullptr;
    const long first = std::strtol(p, &end, 10);
    if (end == p) break;
    long last = first;
    p = end;
    if (*p == '-') {
      last = std::strtol(p + 1, &end, 10);
      p = end;
    }
    count += std::max<long>(0, last - first + 1);
    if (*p == ',') ++p;
  }
  return count;
}

}  // namespace

const CacheShare& cache_share() {
  static const CacheShare share = [] {
    CacheShare s;
    for (int index = 0; index < 8; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
      std::ifstream level_file(dir + "/level"), size_file(dir + "/size"), type_file(dir + "/type"),
          shared_file(dir + "/shared_cpu_list");
      int level = 0;
      std::string size, type, shared;
      if (!(level_file >> level) || !(size_file >> size) || !(type_file >> type)) continue;
      if (type == "Instruction") continue;
      const int64_t bytes = sysfs_cache_bytes(size);
      if (bytes <= 0) continue;
      const int64_t sharing =
          (shared_file >> shared) ? std::max<int64_t>(1, sysfs_cpu_count(shared)) : 1;
      if (level == 2) s.l2 = bytes / sharing;
      if (level == 3) s.l3 = std::min(kL3ShareCap, bytes / sharing);
    }
    return s;
  }();
  return share;
}

}  // namespace qwen4exp::cpu
