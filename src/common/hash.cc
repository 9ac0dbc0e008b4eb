// Hash helpers over xxHash (Debian's libxxhash).
#include "common/hash.h"

#include <xxhash.h>

#include <cstdio>

#include "common/status.h"

namespace hetero {

uint64_t checksum64(const void* data, size_t bytes, uint64_t seed) {
  return XXH64(data, bytes, seed);
}

uint64_t checksum3(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

Checksum3::Checksum3() : state_(XXH3_createState()) {
  HETERO_CHECK(state_ != nullptr);
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

Checksum3::~Checksum3() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void Checksum3::update(const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}

uint64_t Checksum3::digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string prefix_key(const std::string& fingerprint, const std::vector<int32_t>& ids) {
  // Two independent 64-bit lanes make accidental collisions between prefixes negligible.
  uint64_t a = XXH64(fingerprint.data(), fingerprint.size(), 1);
  uint64_t b = XXH64(fingerprint.data(), fingerprint.size(), 2);
  a = XXH64(ids.data(), ids.size() * sizeof(int32_t), a);
  b = XXH64(ids.data(), ids.size() * sizeof(int32_t), b ^ 0x9e3779b97f4a7c15ull);
  return hex64(a) + hex64(b);
}

}  // namespace hetero
