// Who may use the front door, and which partition of the prefix caches each request's prompts
// live in (docs/design/auth.md, "Tenants").
//
// With --api-key-file, each non-empty line of the file is one API key, one tenant; a request
// needs `Authorization: Bearer <key>` (as OpenAI's API), compared in constant time. A request's
// cache salt is HMAC-SHA256(K_salt, "tenant" 0 key 0 cache_salt) as 32 hex digits, K_salt a key
// derived from the stack's secret: every cache (the decoder's prompt cache, the prefill host's
// state and checkpoints) keeps one salt's prompts apart from every other's, so `cached_tokens`
// and a verdict's `reused` count only the caller's own. `cache_salt` is the request's own
// optional field (vLLM's name): one client may keep its own conversations apart too.
// Without a key file the front door is open, and a request without cache_salt shares the one
// unsalted partition, as before. Immutable after load: thread-safe.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/auth.h"
#include "common/status.h"

namespace hetero {

class Tenants {
 public:
  Tenants() = default;
  // path: the API key file ("": open). The file must not be readable by group or others;
  // each key is 16 to 4096 printable ASCII characters.
  static Result<Tenants> load(const std::string& path, std::string_view stack_secret);
  bool open() const { return keys_.empty(); }
  const std::vector<std::string>& keys() const { return keys_; }

  // The caller's key ("" when open), or kFailedPrecondition for a missing or unknown one (the
  // front answers 401 before reading the body).
  Result<std::string> authenticate(std::string_view authorization) const;
  // The request's cache salt for the caller's key ("": the shared partition), or
  // kInvalidArgument for a cache_salt that is not a string of 1 to 1024 characters (400).
  Result<std::string> salt(const std::string& key, const nlohmann::json& body) const;

 private:
  std::vector<std::string> keys_;
  Key32 salt_key_{};
};

}  // namespace hetero
