// Frames authenticated end to end between a prefill host and the decode side that share the
// stack's secret (docs/design/wire.md, "Frame tags"). The xxh64 checksum inside a frame catches
// corruption, not forgery: anyone can compute it. A tag can only be made with the secret.
//
// The decode side sends a fresh random stream_nonce with each request. Both ends derive
//   stream key  K   = HMAC-SHA256(secret, "hetero frame tags v1" | nonce)
//   frame key   k_i = HMAC-SHA256(K, u64le(i))        for the stream's i-th frame (0, 1, ...)
//   tag         t_i = Poly1305(k_i, the frame's bytes, magic to checksum)
// and the host writes t_i (16 bytes) right after frame i. A one-time key per frame is what
// Poly1305 needs; the nonce binds the frames to this request (no replay of an old stream), the
// index to their place in it (no reordering). Poly1305 runs at several GB/s, so tagging costs a
// fraction of the checksum pass it follows.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace hetero {

inline constexpr size_t kFrameTagBytes = 16;
// The prefill host's answer header when its frames carry tags, and its value.
inline constexpr char kFrameTagsHeader[] = "X-Hetero-Frame-Tags";
inline constexpr char kFrameTagsScheme[] = "poly1305-v1";

using FrameTag = std::array<uint8_t, kFrameTagBytes>;

class FrameTagger {
 public:
  // secret: the stack's shared secret (not empty); nonce: the request's stream_nonce.
  FrameTagger(std::string_view secret, std::string_view nonce);
  FrameTag tag(uint64_t index, const char* data, size_t n) const;
  // Compared in time independent of where they differ.
  bool verify(uint64_t index, const char* data, size_t n, const uint8_t* tag) const;

 private:
  std::array<uint8_t, 32> stream_key_{};
};

// A fresh stream_nonce: 16 random bytes from the kernel, as 32 hex digits.
std::string new_stream_nonce();
// What parse_prefill_request accepts as one: 16 to 128 hex digits.
bool valid_stream_nonce(std::string_view nonce);

}  // namespace hetero
