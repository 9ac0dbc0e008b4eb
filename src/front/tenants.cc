// API keys and cache salts: see tenants.h.
#include "front/tenants.h"

#include <openssl/hmac.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>

namespace hetero {

Result<Tenants> Tenants::load(const std::string& path, std::string_view stack_secret) {
  Tenants t;
  t.salt_key_ = derive_key(stack_secret, "cache salts");
  if (path.empty()) return t;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return not_found("cannot read the API key file " + path);
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return invalid_argument("the API key file " + path + " has mode " + mode +
                            ": others may read or change it (chmod 600 " + path + ")");
  }
  std::ifstream in(path);
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    const size_t b = line.find_first_not_of(" \t\r"), e = line.find_last_not_of(" \t\r");
    if (b == std::string::npos) continue;
    const std::string key = line.substr(b, e - b + 1);
    bool printable = true;
    for (char c : key) printable = printable && c > ' ' && c < 0x7f;
    if (key.size() < 16 || key.size() > 4096 || !printable)
      return invalid_argument("the API key file " + path + ", line " + std::to_string(line_no) +
                              ": a key is 16 to 4096 printable ASCII characters, no spaces");
    t.keys_.push_back(key);
    if (t.keys_.size() > 65536)
      return invalid_argument("the API key file " + path + " holds more than 65536 keys");
  }
  if (t.keys_.empty()) return invalid_argument("the API key file " + path + " holds no key");
  return t;
}

Result<std::string> Tenants::authenticate(std::string_view authorization) const {
  if (open()) return std::string();
  const std::string_view given = bearer_token(authorization);
  const std::string* match = nullptr;
  for (const std::string& k : keys_)  // every key compared, whichever matches
    if (same_secret(given, k)) match = &k;
  if (match == nullptr)
    return failed_precondition(given.empty()
                                   ? "this server needs an API key: Authorization: Bearer <key>"
                                   : "the API key is not valid here");
  return *match;
}

Result<std::string> Tenants::salt(const std::string& key, const nlohmann::json& body) const {
  std::string cache_salt;
  if (body.is_object() && body.contains("cache_salt")) {
    const auto& v = body["cache_salt"];
    if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 1024)
      return invalid_argument("'cache_salt' must be a string of 1 to 1024 characters");
    cache_salt = v.get<std::string>();
  }
  if (key.empty() && cache_salt.empty()) return std::string();  // the shared partition
  std::string msg = "tenant";
  msg.push_back('\0');
  msg += key;
  msg.push_back('\0');
  msg += cache_salt;
  uint8_t out[32];
  unsigned int len = 0;
  HMAC(EVP_sha256(), salt_key_.data(), static_cast<int>(salt_key_.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len);
  return to_hex(out, 16);
}

}  // namespace hetero
