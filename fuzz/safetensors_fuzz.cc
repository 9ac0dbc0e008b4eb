// libFuzzer target: safetensors files as every loader reads them (read_safetensors): header
// length, JSON header, dtypes, shapes and offsets, all from the file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An in-memory file, read through the same path as a file on disk.
  static const int fd = memfd_create("hetero-fuzz.safetensors", 0);
  if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))
    return 0;
  (void)hetero::read_safetensors("/proc/self/fd/" + std::to_string(fd));
  return 0;
}
