// Host memory: see sysmem.h.
#include "common/sysmem.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace hetero {
namespace {

// The first integer of a one-line file ("max" and unreadable: -1).
int64_t read_int(const char* path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    return std::stoll(word);
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024.0 && u < 5) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  return buf;
}

int64_t host_available_bytes() {
  int64_t available = -1;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") {
      available = kib * 1024;
      break;
    }
  }
  const int64_t limit = read_int("/sys/fs/cgroup/memory.max");  // cgroup v2
  const int64_t used = read_int("/sys/fs/cgroup/memory.current");
  if (limit > 0 && used >= 0) {
    const int64_t left = limit > used ? limit - used : 0;
    available = available < 0 ? left : std::min(available, left);
  }
  return available;
}

}  // namespace hetero
