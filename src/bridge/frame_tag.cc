// Frame tags: see frame_tag.h.
#include "bridge/frame_tag.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace hetero {
namespace {

constexpr char kLabel[] = "hetero frame tags v1";

std::array<uint8_t, 32> hmac_sha256(const uint8_t* key, size_t key_len, const void* data,
                                    size_t n) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  HETERO_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(key_len),
                    static_cast<const unsigned char*>(data), n, out.data(), &len) != nullptr &&
               len == out.size());
  return out;
}

// OpenSSL's Poly1305, fetched once (thread-safe static); a context per call.
EVP_MAC* poly1305() {
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "POLY1305", nullptr);
  HETERO_CHECK(mac != nullptr);
  return mac;
}

}  // namespace

FrameTagger::FrameTagger(std::string_view secret, std::string_view nonce) {
  std::string msg(kLabel, sizeof kLabel);  // the label with its NUL: label and nonce stay apart
  msg.append(nonce);
  stream_key_ = hmac_sha256(reinterpret_cast<const uint8_t*>(secret.data()), secret.size(),
                            msg.data(), msg.size());
}

FrameTag FrameTagger::tag(uint64_t index, const char* data, size_t n) const {
  uint8_t le[8];
  for (int b = 0; b < 8; ++b) le[b] = static_cast<uint8_t>(index >> (8 * b));
  std::array<uint8_t, 32> key = hmac_sha256(stream_key_.data(), stream_key_.size(), le, 8);
  std::unique_ptr<EVP_MAC_CTX, decltype(&EVP_MAC_CTX_free)> ctx(EVP_MAC_CTX_new(poly1305()),
                                                                &EVP_MAC_CTX_free);
  FrameTag out{};
  size_t len = 0;
  HETERO_CHECK(ctx && EVP_MAC_init(ctx.get(), key.data(), key.size(), nullptr) == 1 &&
               EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(data), n) == 1 &&
               EVP_MAC_final(ctx.get(), out.data(), &len, out.size()) == 1 && len == out.size());
  OPENSSL_cleanse(key.data(), key.size());
  return out;
}

bool FrameTagger::verify(uint64_t index, const char* data, size_t n, const uint8_t* tag) const {
  const FrameTag want = this->tag(index, data, n);
  return CRYPTO_memcmp(want.data(), tag, want.size()) == 0;
}

std::string new_stream_nonce() {
  uint8_t bytes[16];
  for (size_t got = 0; got < sizeof bytes;) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    HETERO_CHECK(n > 0);  // the kernel's generator does not fail once the system is up
    got += static_cast<size_t>(n);
  }
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
