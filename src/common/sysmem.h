// The host's memory as a process can use it, and byte counts for messages.
#pragma once

#include <cstdint>
#include <string>

namespace hetero {

// "12.3 GiB", "512.0 MiB", "96 B".
std::string format_bytes(int64_t bytes);

// Bytes this process could still allocate without swapping or being killed: the kernel's
// MemAvailable, lowered to what the process's cgroup limit leaves (containers report the
// host's meminfo). -1 when neither can be read.
int64_t host_available_bytes();

}  // namespace hetero
