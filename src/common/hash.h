// Checksums and keys. Frames carry XXH3-64 checksums of their pieces (fast, collision-resistant
// enough to catch corruption, not an authenticator). Store keys chain XXH64 over the token prefix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hetero {

uint64_t checksum64(const void* data, size_t bytes, uint64_t seed = 0);

// XXH3-64 (seed 0): a frame piece's checksum, and the frame's over its pieces' (wire.h).
uint64_t checksum3(const void* data, size_t bytes);

// checksum3 over bytes that arrive in parts: digest() equals checksum3 of their concatenation.
// Move-only.
class Checksum3 {
 public:
  Checksum3();
  ~Checksum3();
  Checksum3(Checksum3&& o) noexcept : state_(o.state_) { o.state_ = nullptr; }
  Checksum3& operator=(Checksum3&&) = delete;
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t
};
std::string hex64(uint64_t v);
// Key of a decoder-store entry: hash of the model fingerprint and ids[0:n], as hex.
std::string prefix_key(const std::string& fingerprint, const std::vector<int32_t>& ids);

}  // namespace hetero
