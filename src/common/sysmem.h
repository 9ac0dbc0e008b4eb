// The host's memory as a process can use it, and byte counts for messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace hetero {

// "12.3 GiB", "512.0 MiB", "96 B".
std::string format_bytes(int64_t bytes);

// Bytes this process could still allocate without swapping or being killed: the kernel's
// MemAvailable, lowered to what the process's cgroup limit leaves (containers report the
// host's meminfo). -1 when neither can be read.
int64_t host_available_bytes();

// Whether an engine may hold `whole` bytes for `what` ("the cache of 5481 tokens"), `held` of
// them held already: within `budget` when it is > 0; without one, within half of what the host
// could give (the other half is left to the decoder and the rest of the machine); and the part
// not yet held within what is available now. kResourceExhausted with the numbers otherwise, so
// that a prompt that would not fit is sealed or refused before its first allocation.
Status check_host_memory(int64_t whole, int64_t held, int64_t budget, const std::string& what);

// Fresh memory of hundreds of MB costs as much to fault in, 4 KB page by page, as to fill. Where
// the kernel backs madvise'd ranges with huge pages, this asks for them over [p, p + bytes) (a
// hint: ranges under 8 MB and errors are left alone). Before the first write.
void prefer_huge_pages(const void* p, size_t bytes);

// `n` elements of fresh, uninitialized host memory (no zero-fill: a device copy or the caller
// writes every one), huge pages asked for: state copied off a device in one piece.
template <typename T>
std::unique_ptr<T[]> uninitialized_host_array(size_t n) {
  std::unique_ptr<T[]> a(new T[n]);
  prefer_huge_pages(a.get(), n * sizeof(T));
  return a;
}

}  // namespace hetero
