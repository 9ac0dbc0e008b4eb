// Requests between the stack's processes, signed with a key derived from the stack's secret,
// and checked without the secret ever crossing a socket (docs/design/auth.md):
//   K_req   = HMAC-SHA256(secret, "hetero/auth/v1 requests")
//   K_frame = HMAC-SHA256(secret, "hetero/auth/v1 frame tags")   (the frame tags, wire.md)
//   Authorization: Hetero-HMAC-SHA256 t=<unix s>, n=<32 hex>, s=<64 hex>
//   s = hex HMAC-SHA256(K_req, "hetero-request-v1\n" METHOD "\n" TARGET "\n"
//                              hex(SHA256(body)) "\n" t "\n" n)
// The Python seam implements the same (python/hetero_mlx/access.py); a fixed vector holds both
// to it (tests/unit/auth_test.cc, tests/py/test_seam.py).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "common/http_server.h"

namespace hetero {

using Key32 = std::array<uint8_t, 32>;

inline constexpr char kRequestKeyPurpose[] = "requests";
inline constexpr char kFrameKeyPurpose[] = "frame tags";
inline constexpr char kAuthScheme[] = "Hetero-HMAC-SHA256";
// A request's clock may differ from the receiver's by this much; its nonce is remembered for
// twice as long, so a replay is refused for as long as its time would pass.
inline constexpr int64_t kAuthMaxSkewS = 300;
inline constexpr int64_t kAuthNonceMemoryS = 600;
inline constexpr size_t kAuthMaxNonces = 262144;

// HMAC-SHA256(secret, "hetero/auth/v1 " purpose).
Key32 derive_key(std::string_view secret, std::string_view purpose);
std::string to_hex(const uint8_t* data, size_t n);
int64_t unix_now_s();

// The Authorization header's value for a request; "" for an empty secret (an open stack).
std::string signed_authorization(std::string_view secret, std::string_view method,
                                 std::string_view target, std::string_view body);
// The same at a given time with a given nonce (32 lowercase hex digits): the fixed test vector.
std::string signed_authorization_at(std::string_view secret, std::string_view method,
                                    std::string_view target, std::string_view body, int64_t unix_s,
                                    std::string_view nonce_hex);

// Why a request is refused: HTTP status, a stable code, a message.
struct AuthRefusal {
  int status = 401;
  std::string code, message;
};

// Checks signed requests for one server. Thread-safe.
class RequestVerifier {
 public:
  explicit RequestVerifier(std::string_view secret);  // empty: every request passes (open)
  bool open() const { return open_; }
  // Before the body is read: the header is well formed and its time within kAuthMaxSkewS.
  std::optional<AuthRefusal> check_head(std::string_view authorization, int64_t now_s) const;
  // The signature over the whole request, then its nonce, remembered once the signature checks
  // (nobody without the key can fill the memory).
  std::optional<AuthRefusal> check_whole(std::string_view authorization, std::string_view method,
                                         std::string_view target, std::string_view body,
                                         int64_t now_s);

 private:
  bool open_ = true;
  Key32 key_{};
  std::mutex mu_;
  std::unordered_map<std::string, int64_t> seen_;  // nonce -> when it may be forgotten
  std::deque<std::pair<int64_t, std::string>> expiry_;
};

// The server's check: every request whose path `protect` names must be signed; a refusal is
// `status` with error_body(status, code, message) and, for clock_skew, X-Hetero-Time.
RequestCheck signed_request_check(
    std::shared_ptr<RequestVerifier> verifier, std::function<bool(std::string_view path)> protect,
    std::function<std::string(int status, const std::string& code, const std::string& message)>
        error_body);

// A tenant's cache salt as it travels between processes: 1 to 64 lowercase hex digits.
bool valid_cache_salt(std::string_view salt);

// The token of an `Authorization: Bearer <token>` header ("" when it is not one).
std::string_view bearer_token(std::string_view authorization);
// a == b in time independent of where they differ (their lengths may show).
bool same_secret(std::string_view a, std::string_view b);

}  // namespace hetero
