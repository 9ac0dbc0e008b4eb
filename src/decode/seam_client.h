// The decoder seam (/hetero/* on the decoder's own port) as the decode side calls it: one
// object per decoder, each call with the same deadline and the stack's secret (the seam
// requires it when started with one), every failure a Status naming the endpoint.
// Thread-safe (each call opens its own connection).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/http_json.h"
#include "common/status.h"

namespace hetero {

class SeamClient {
 public:
  // secret: the stack's shared secret ("" for a seam started without one).
  SeamClient(std::string host, int port, int64_t timeout_ms = 60000, std::string secret = "")
      : host_(std::move(host)), port_(port), timeout_ms_(timeout_ms), secret_(std::move(secret)) {}
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  // The same decoder, each prompt-cache call (cached_prefix, mount) in the partition of a
  // tenant's cache salt (docs/design/auth.md, "Tenants"; "": the shared one).
  SeamClient salted(std::string salt) const {
    SeamClient c = *this;
    c.salt_ = std::move(salt);
    return c;
  }
  const std::string& salt() const { return salt_; }

  // GET /hetero/info: the decoder's layout, fingerprint, schedule, store.
  Result<nlohmann::json> info() const { return call("/hetero/info", nlohmann::json()); }
  // POST /hetero/tokenize: the reply as is (a 4xx is the decoder rejecting the request).
  Result<HttpJsonReply> tokenize(const nlohmann::json& request) const;
  // How many leading ids the decoder would take from its prompt cache now.
  Result<int64_t> cached_prefix(const std::vector<int32_t>& ids) const;
  // Mounts a store entry for ids[:B]; the reply's "pin" holds the entry until the decoder has
  // looked it up for these ids (or unpin).
  Result<nlohmann::json> mount(const std::string& entry, const std::vector<int32_t>& ids) const;
  // Releases a pin (idempotent; "" is a no-op). Best effort: a pin also expires on its own.
  // evict: the mounted entry also leaves the decoder's cache (a mount that failed its check).
  void unpin(const std::string& pin, bool evict = false) const;
  // Any other seam endpoint (clear, cache dumps): 2xx JSON or a Status.
  Result<nlohmann::json> call(const std::string& path, const nlohmann::json& body) const {
    return http_json_ok(host_, port_, path, body, timeout_ms_, secret_);
  }

 private:
  std::string host_;
  int port_;
  int64_t timeout_ms_;
  std::string secret_;
  std::string salt_;
};

}  // namespace hetero
