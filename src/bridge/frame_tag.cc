// Frame tags: see frame_tag.h.
#include "bridge/frame_tag.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/auth.h"

namespace hetero {
namespace {

constexpr char kLabel[] = "hetero frame tags v3";
constexpr char kPieceLabel[] = "piece";
constexpr char kFrameLabel[] = "frame";

using Key = std::array<uint8_t, 32>;

Key hmac_sha256(const uint8_t* key, size_t key_len, const void* data, size_t n) {
  Key out{};
  unsigned int len = 0;
  HETERO_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(key_len),
                    static_cast<const unsigned char*>(data), n, out.data(), &len) != nullptr &&
               len == out.size());
  return out;
}

// OpenSSL's Poly1305, fetched once (thread-safe static); a context per MAC.
EVP_MAC* poly1305() {
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "POLY1305", nullptr);
  HETERO_CHECK(mac != nullptr);
  return mac;
}

void* new_poly1305(Key key) {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(poly1305());
  HETERO_CHECK(ctx && EVP_MAC_init(ctx, key.data(), key.size(), nullptr) == 1);
  OPENSSL_cleanse(key.data(), key.size());
  return ctx;
}

void put_u64(uint8_t* out, uint64_t v) {
  for (int b = 0; b < 8; ++b) out[b] = static_cast<uint8_t>(v >> (8 * b));
}

void fill_random(uint8_t* bytes, size_t n) {
  for (size_t got = 0; got < n;) {
    const ssize_t r = getrandom(bytes + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    HETERO_CHECK(r > 0);  // the kernel's generator does not fail once the system is up
    got += static_cast<size_t>(r);
  }
}

}  // namespace

PieceMac::PieceMac(PieceMac&& o) noexcept : ctx_(std::exchange(o.ctx_, nullptr)) {}
PieceMac& PieceMac::operator=(PieceMac&& o) noexcept {
  std::swap(ctx_, o.ctx_);
  return *this;
}
PieceMac::~PieceMac() { EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_)); }

void PieceMac::update(const void* data, size_t n) {
  HETERO_CHECK(ctx_ && EVP_MAC_update(static_cast<EVP_MAC_CTX*>(ctx_),
                                      static_cast<const unsigned char*>(data), n) == 1);
}

FrameTag PieceMac::final() {
  FrameTag out{};
  size_t len = 0;
  HETERO_CHECK(ctx_ &&
               EVP_MAC_final(static_cast<EVP_MAC_CTX*>(ctx_), out.data(), &len, out.size()) == 1 &&
               len == out.size());
  EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(std::exchange(ctx_, nullptr)));
  return out;
}

FrameTagger::FrameTagger(std::string_view secret, std::string_view nonce) {
  std::string msg(kLabel, sizeof kLabel);  // the label with its NUL: label and nonce stay apart
  msg.append(nonce);
  // Keyed by the frame-tag key, never by the secret itself: a request's signature (under the
  // request key) tells nothing about it (docs/design/auth.md).
  Key frame_key = derive_key(secret, kFrameKeyPurpose);
  stream_key_ = hmac_sha256(frame_key.data(), frame_key.size(), msg.data(), msg.size());
  OPENSSL_cleanse(frame_key.data(), frame_key.size());
}

FrameSalt FrameTagger::new_salt() {
  FrameSalt s;
  fill_random(s.data(), s.size());
  return s;
}

PieceMac FrameTagger::piece(const FrameSalt& salt, uint64_t j) const {
  uint8_t msg[sizeof kPieceLabel + kFrameSaltBytes + 8];
  std::memcpy(msg, kPieceLabel, sizeof kPieceLabel);
  std::memcpy(msg + sizeof kPieceLabel, salt.data(), salt.size());
  put_u64(msg + sizeof kPieceLabel + kFrameSaltBytes, j);
  PieceMac m;
  m.ctx_ = new_poly1305(hmac_sha256(stream_key_.data(), stream_key_.size(), msg, sizeof msg));
  return m;
}

FrameTag FrameTagger::digest(const FrameSalt& salt, const char* prefix16, uint64_t checksum,
                             const std::vector<FrameTag>& pieces) const {
  uint8_t msg[sizeof kFrameLabel + kFrameSaltBytes];
  std::memcpy(msg, kFrameLabel, sizeof kFrameLabel);
  std::memcpy(msg + sizeof kFrameLabel, salt.data(), salt.size());
  PieceMac m;
  m.ctx_ = new_poly1305(hmac_sha256(stream_key_.data(), stream_key_.size(), msg, sizeof msg));
  m.update(prefix16, 16);
  uint8_t sum[8];
  put_u64(sum, checksum);
  m.update(sum, 8);
  if (!pieces.empty()) m.update(pieces.data(), pieces.size() * kFrameTagBytes);
  return m.final();
}

FrameTag FrameTagger::tag(uint64_t index, const FrameSalt& salt, const FrameTag& digest) const {
  uint8_t le[8];
  put_u64(le, index);
  PieceMac m;
  m.ctx_ = new_poly1305(hmac_sha256(stream_key_.data(), stream_key_.size(), le, 8));
  m.update(salt.data(), salt.size());
  m.update(digest.data(), digest.size());
  return m.final();
}

void FrameTagger::seal(uint64_t index, std::string* frame) const {
  HETERO_CHECK(frame->size() >= kFrameSealBytes);
  uint8_t* end = reinterpret_cast<uint8_t*>(frame->data() + frame->size());
  FrameSalt salt;
  FrameTag d;
  std::memcpy(salt.data(), end - kFrameSealBytes, kFrameSaltBytes);
  std::memcpy(d.data(), end - kFrameTagBytes, kFrameTagBytes);
  const FrameTag t = tag(index, salt, d);
  std::memcpy(end - kFrameTagBytes, t.data(), t.size());
}

bool FrameTagger::same(const FrameTag& a, const uint8_t* b) {
  return CRYPTO_memcmp(a.data(), b, a.size()) == 0;
}

std::string new_stream_nonce() {
  uint8_t bytes[16];
  fill_random(bytes, sizeof bytes);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (uint8_t b : bytes) hex += {kHex[b >> 4], kHex[b & 15]};
  return hex;
}

bool valid_stream_nonce(std::string_view nonce) {
  if (nonce.size() < 16 || nonce.size() > 128) return false;
  for (char c : nonce)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace hetero
