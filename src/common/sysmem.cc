// Host memory: see sysmem.h.
#include "common/sysmem.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>

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

// "1.2 MiB" for each, or with the exact bytes beside them where the two would read the same.
std::pair<std::string, std::string> show_both(int64_t a, int64_t b) {
  std::string x = format_bytes(a), y = format_bytes(b);
  if (x == y && a != b)
    x += " (" + std::to_string(a) + " bytes)", y += " (" + std::to_string(b) + " bytes)";
  return {x, y};
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

Status check_host_memory(int64_t whole, int64_t held, int64_t budget, const std::string& what) {
  if (budget > 0 && whole > budget) {
    const auto [asked, allowed] = show_both(whole, budget);
    return resource_exhausted("over the host memory budget: " + what + " needs " + asked +
                              "; the budget is " + allowed);
  }
  const int64_t available = host_available_bytes();
  if (budget <= 0 && available >= 0 && whole > (available + held) / 2)
    return resource_exhausted("out of host memory: asked " + format_bytes(whole) + " for " + what +
                              "; half the host's available memory is " +
                              format_bytes((available + held) / 2) +
                              " (--host-memory-budget-mb sets the budget)");
  const int64_t more = whole - held;
  if (more > 0 && available >= 0 && more > available)
    return resource_exhausted("out of host memory: asked " + format_bytes(more) + " for " + what +
                              "; " + format_bytes(available) + " available");
  return Status::ok();
}

void prefer_huge_pages(const void* p, size_t bytes) {
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);  // a hint: errors ignored
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace hetero
