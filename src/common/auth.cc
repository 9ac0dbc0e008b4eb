// Signed requests: see auth.h.
#include "common/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <chrono>
#include <cstdio>

namespace hetero {
namespace {

constexpr char kKeyLabel[] = "hetero/auth/v1 ";
constexpr char kSignedLabel[] = "hetero-request-v1\n";

Key32 hmac(const uint8_t* key, size_t key_len, std::string_view data) {
  Key32 out{};
  unsigned int len = 0;
  HETERO_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(key_len),
                    reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(),
                    &len) != nullptr &&
               len == out.size());
  return out;
}

std::string body_digest_hex(std::string_view body) {
  uint8_t d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(body.data()), body.size(), d);
  return to_hex(d, sizeof d);
}

std::string signature_hex(const Key32& key, std::string_view method, std::string_view target,
                          std::string_view body, std::string_view t, std::string_view n) {
  std::string m = kSignedLabel;
  m.append(method).append("\n").append(target).append("\n").append(body_digest_hex(body));
  m.append("\n").append(t).append("\n").append(n);
  const Key32 s = hmac(key.data(), key.size(), m);
  return to_hex(s.data(), s.size());
}

bool all_of(std::string_view s, std::string_view allowed) {
  return s.find_first_not_of(allowed) == std::string_view::npos;
}

// The header's three fields, checked for shape only.
struct Parsed {
  std::string_view t, n, s;
  int64_t time = 0;
};

std::optional<Parsed> parse(std::string_view h) {
  const std::string_view scheme = kAuthScheme;
  if (h.substr(0, scheme.size()) != scheme || h.size() <= scheme.size() || h[scheme.size()] != ' ')
    return std::nullopt;
  h.remove_prefix(scheme.size() + 1);
  Parsed p;
  for (std::string_view* field : {&p.t, &p.n, &p.s}) {
    while (!h.empty() && h.front() == ' ') h.remove_prefix(1);
    const char name = field == &p.t ? 't' : field == &p.n ? 'n' : 's';
    if (h.size() < 2 || h[0] != name || h[1] != '=') return std::nullopt;
    h.remove_prefix(2);
    const size_t end = h.find(',');
    *field = h.substr(0, end);
    // Three fields, comma-separated, nothing after the last.
    if ((end == std::string_view::npos) != (field == &p.s)) return std::nullopt;
    h = end == std::string_view::npos ? std::string_view() : h.substr(end + 1);
  }
  if (p.t.empty() || p.t.size() > 12 || !all_of(p.t, "0123456789")) return std::nullopt;
  if (p.n.size() != 32 || !all_of(p.n, "0123456789abcdef")) return std::nullopt;
  if (p.s.size() != 64 || !all_of(p.s, "0123456789abcdef")) return std::nullopt;
  for (char c : p.t) p.time = p.time * 10 + (c - '0');
  return p;
}

AuthRefusal refusal(int status, std::string code, std::string message) {
  return AuthRefusal{status, std::move(code), std::move(message)};
}

}  // namespace

std::string to_hex(const uint8_t* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 15];
  }
  return out;
}

int64_t unix_now_s() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Key32 derive_key(std::string_view secret, std::string_view purpose) {
  return hmac(reinterpret_cast<const uint8_t*>(secret.data()), secret.size(),
              std::string(kKeyLabel) + std::string(purpose));
}

std::string signed_authorization_at(std::string_view secret, std::string_view method,
                                    std::string_view target, std::string_view body, int64_t unix_s,
                                    std::string_view nonce_hex) {
  if (secret.empty()) return "";
  Key32 key = derive_key(secret, kRequestKeyPurpose);
  const std::string t = std::to_string(unix_s);
  const std::string s = signature_hex(key, method, target, body, t, nonce_hex);
  OPENSSL_cleanse(key.data(), key.size());
  return std::string(kAuthScheme) + " t=" + t + ", n=" + std::string(nonce_hex) + ", s=" + s;
}

std::string signed_authorization(std::string_view secret, std::string_view method,
                                 std::string_view target, std::string_view body) {
  if (secret.empty()) return "";
  uint8_t nonce[16];
  HETERO_CHECK(RAND_bytes(nonce, sizeof nonce) == 1);
  return signed_authorization_at(secret, method, target, body, unix_now_s(),
                                 to_hex(nonce, sizeof nonce));
}

RequestVerifier::RequestVerifier(std::string_view secret) : open_(secret.empty()) {
  if (!open_) key_ = derive_key(secret, kRequestKeyPurpose);
}

std::optional<AuthRefusal> RequestVerifier::check_head(std::string_view authorization,
                                                       int64_t now_s) const {
  if (open_) return std::nullopt;
  const auto p = parse(authorization);
  if (!p)
    return refusal(401, "unauthorized",
                   "this endpoint needs a request signed with the stack's secret "
                   "(Authorization: Hetero-HMAC-SHA256 t=..., n=..., s=...; docs/design/auth.md)");
  if (p->time > now_s + kAuthMaxSkewS || p->time < now_s - kAuthMaxSkewS)
    return refusal(401, "clock_skew",
                   "the request's time " + std::to_string(p->time) + " is more than " +
                       std::to_string(kAuthMaxSkewS) + " s from this host's " +
                       std::to_string(now_s) + ": check both clocks");
  return std::nullopt;
}

std::optional<AuthRefusal> RequestVerifier::check_whole(std::string_view authorization,
                                                        std::string_view method,
                                                        std::string_view target,
                                                        std::string_view body, int64_t now_s) {
  if (open_) return std::nullopt;
  if (auto r = check_head(authorization, now_s)) return r;
  const Parsed p = *parse(authorization);
  const std::string want = signature_hex(key_, method, target, body, p.t, p.n);
  if (!same_secret(want, p.s))
    return refusal(401, "bad_signature",
                   "the request's signature does not check: another secret, or a request "
                   "changed on the way");
  std::lock_guard<std::mutex> lock(mu_);
  while (!expiry_.empty() && expiry_.front().first <= now_s) {
    seen_.erase(expiry_.front().second);
    expiry_.pop_front();
  }
  const std::string nonce(p.n);
  if (seen_.count(nonce))
    return refusal(401, "replayed", "this request was already received (its nonce is not new)");
  if (seen_.size() >= kAuthMaxNonces)
    return refusal(503, "busy",
                   "too many signed requests in the last " + std::to_string(kAuthNonceMemoryS) +
                       " s; retry shortly");
  seen_.emplace(nonce, now_s + kAuthNonceMemoryS);
  expiry_.emplace_back(now_s + kAuthNonceMemoryS, nonce);
  return std::nullopt;
}

RequestCheck signed_request_check(
    std::shared_ptr<RequestVerifier> verifier, std::function<bool(std::string_view path)> protect,
    std::function<std::string(int, const std::string&, const std::string&)> error_body) {
  auto refuse = [error_body](const AuthRefusal& r, HttpResponse& res) {
    res.status = r.status;
    res.set_content(error_body(r.status, r.code, r.message), "application/json");
    if (r.code == "clock_skew") res.set_header("X-Hetero-Time", std::to_string(unix_now_s()));
    if (r.status == 401) res.set_header("WWW-Authenticate", kAuthScheme);
    return false;
  };
  RequestCheck check;
  check.head = [verifier, protect, refuse](const HttpRequest& req, HttpResponse& res) {
    if (verifier->open() || !protect(req.path)) return true;
    auto r = verifier->check_head(req.header("Authorization"), unix_now_s());
    return r ? refuse(*r, res) : true;
  };
  check.whole = [verifier, protect, refuse](const HttpRequest& req, HttpResponse& res) {
    if (verifier->open() || !protect(req.path)) return true;
    auto r = verifier->check_whole(req.header("Authorization"), req.method, req.target, req.body,
                                   unix_now_s());
    return r ? refuse(*r, res) : true;
  };
  return check;
}

bool valid_cache_salt(std::string_view salt) {
  return !salt.empty() && salt.size() <= 64 && all_of(salt, "0123456789abcdef");
}

std::string_view bearer_token(std::string_view authorization) {
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() <= kBearer.size()) return {};
  for (size_t i = 0; i < kBearer.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(authorization[i])) !=
        std::tolower(static_cast<unsigned char>(kBearer[i])))
      return {};
  return authorization.substr(kBearer.size());
}

bool same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i)
    diff |= static_cast<unsigned char>(b[i]) ^ static_cast<unsigned char>(i < a.size() ? a[i] : 0);
  return diff == 0;
}

}  // namespace hetero
