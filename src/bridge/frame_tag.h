// Frames authenticated end to end between a prefill host and the decode side that share the
// stack's secret (docs/design/wire.md, "Frame tags"). The checksum inside a frame catches
// corruption, not forgery: anyone can compute it. A tag can only be made with the secret.
//
// The decode side sends a fresh random stream_nonce with each request. Both ends derive
//   stream key  K          = HMAC-SHA256(K_frame, "hetero frame tags v3" | 0 | nonce)
// with K_frame the secret's frame-tag key (common/auth.h: never the secret itself, and not
// the key that signs requests).
// and a frame is tagged in two steps, so that the long part runs where and when the frame is
// written (in parallel over its pieces, as its bytes land) and only a short one when it is sent:
//   framing: a random 16-byte salt; for each 1 MiB piece j of header | payload
//              p_j = Poly1305(HMAC(K, "piece" | 0 | salt | u64le(j)), piece j)
//            D   = Poly1305(HMAC(K, "frame" | 0 | salt), prefix | u64le(checksum) | p_0 | p_1 ...)
//   sending: the stream's i-th frame (0, 1, ...) gets
//            t_i = Poly1305(HMAC(K, u64le(i)), salt | D)
// and salt | t_i (32 bytes) follow the frame. Every Poly1305 key is used once: the salt makes
// the framing keys the frame's own, i the sending key the frame's place in the stream. D is
// never sent; t_i hides it (Poly1305's added key half). The nonce binds the frames to this
// request (no replay of an old stream), i to their order (no reordering or dropping).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace hetero {

inline constexpr size_t kFrameTagBytes = 16;
inline constexpr size_t kFrameSaltBytes = 16;
// What follows a tagged frame on the wire: its salt, then its tag.
inline constexpr size_t kFrameSealBytes = kFrameSaltBytes + kFrameTagBytes;
// The prefill host's answer header when its frames carry tags, and its value.
inline constexpr char kFrameTagsHeader[] = "X-Hetero-Frame-Tags";
inline constexpr char kFrameTagsScheme[] = "poly1305-pieces-v3";

using FrameTag = std::array<uint8_t, kFrameTagBytes>;
using FrameSalt = std::array<uint8_t, kFrameSaltBytes>;

// One piece's Poly1305, fed as its bytes arrive. Move-only.
class PieceMac {
 public:
  PieceMac() = default;
  PieceMac(PieceMac&&) noexcept;
  PieceMac& operator=(PieceMac&&) noexcept;
  ~PieceMac();
  void update(const void* data, size_t n);
  FrameTag final();

 private:
  friend class FrameTagger;
  void* ctx_ = nullptr;  // EVP_MAC_CTX
};

class FrameTagger {
 public:
  // secret: the stack's shared secret (not empty); nonce: the request's stream_nonce.
  FrameTagger(std::string_view secret, std::string_view nonce);

  // Framing: a fresh salt, a piece's MAC, and the frame's digest D.
  static FrameSalt new_salt();
  PieceMac piece(const FrameSalt& salt, uint64_t j) const;
  FrameTag digest(const FrameSalt& salt, const char* prefix16, uint64_t checksum,
                  const std::vector<FrameTag>& pieces) const;
  // Sending: the stream's index-th frame's tag.
  FrameTag tag(uint64_t index, const FrameSalt& salt, const FrameTag& digest) const;
  // A framed frame, whose last 16 bytes hold its digest D, becomes the index-th frame of the
  // stream: D is overwritten by t_index.
  void seal(uint64_t index, std::string* frame) const;
  // Compared in time independent of where they differ.
  static bool same(const FrameTag& a, const uint8_t* b);

 private:
  std::array<uint8_t, 32> stream_key_{};
};

// A fresh stream_nonce: 16 random bytes from the kernel, as 32 hex digits.
std::string new_stream_nonce();
// What parse_prefill_request accepts as one: 16 to 128 hex digits.
bool valid_stream_nonce(std::string_view nonce);

}  // namespace hetero
