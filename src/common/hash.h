// Checksums and keys. Segments carry XXH64 of their bytes (fast, collision-resistant enough to
// catch corruption, not an authenticator). Store keys chain a hash over the token prefix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hetero {

uint64_t checksum64(const void* data, size_t bytes, uint64_t seed = 0);

// checksum64 over bytes that arrive in pieces: digest() equals checksum64 of their concatenation.
class Checksum64 {
 public:
  explicit Checksum64(uint64_t seed = 0);
  ~Checksum64();
  Checksum64(const Checksum64&) = delete;
  Checksum64& operator=(const Checksum64&) = delete;
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  void* state_;  // XXH64_state_t
};
std::string hex64(uint64_t v);
// Key of a decoder-store entry: hash of the model fingerprint and ids[0:n], as hex.
std::string prefix_key(const std::string& fingerprint, const std::vector<int32_t>& ids);

}  // namespace hetero
